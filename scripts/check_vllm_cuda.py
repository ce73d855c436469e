"""The workbench's vLLM plugin on a machine with a GPU (vLLM's CUDA build), with vLLM's own defaults.

Installs nothing: run it with the Python of that machine's vLLM, the workbench beside it
(`pip install pagedkv_workbench-*.whl`, from `make wheel`, in that environment). Starts vLLM's server with the platform's
defaults, the plugin on, runs a short mixed workload clean and then with one planted fault, and
prints which checks ran on which path and whether the fault was caught (workbench/adapters/vllm/hwcheck.py).

    python scripts/check_vllm_cuda.py --model /path/to/hf_model_dir
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.adapters.vllm.hwcheck import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("cuda"))
