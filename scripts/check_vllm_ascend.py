"""check_vllm_cuda.py for an Ascend NPU: vLLM with vllm-ascend, its defaults, the plugin on
(NPUModelRunner, v1 or v2, calls its metadata builders' build directly: the plugin's hook is there).

    python scripts/check_vllm_ascend.py --model /path/to/hf_model_dir
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":
    from workbench.adapters.vllm.hwcheck import main
    sys.exit(main("ascend"))
