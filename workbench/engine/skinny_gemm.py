"""Build and load the skinny GEMM (csrc/skinny_gemm.cpp): decode-sized linears, fp32 or bf16 weights.

Built like the decode attention kernel (attention/native.py: once per machine, `make`
builds it during setup). `kernel()` is None without a compiler or with PAGEDKV_LINEAR=torch;
the linears then keep oneDNN / F.linear: slower at decode sizes, same results.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from . import cpu_bf16
from .attention.native import compile_extension

SOURCE = Path(__file__).with_name("csrc") / "skinny_gemm.cpp"
ACT = {"none": 0, "silu": 1}
BIN = {"none": 0, "mul": 1, "add": 2}
_lock = threading.Lock()
_state: dict = {}


def kernel():
    """The loaded module, or None (the reason in `unavailable_reason()`)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            if os.environ.get("PAGEDKV_LINEAR", "auto") == "torch":
                _state["module"], _state["why"] = None, "PAGEDKV_LINEAR=torch"
            else:
                _state["module"], _state["why"] = compile_extension("pagedkv_skinny_gemm", [SOURCE],
                                                                    "compiled skinny GEMM")
        return _state["module"]


def bf16_pairs() -> bool:
    """Whether native bf16 can run the bf16 pair kernel (gemm_bf): the build has avx512_bf16
    (-march=native) and so does this CPU (a cached build can be another host's, or PAGEDKV_BF16=native
    forced on a CPU without it)."""
    k = kernel()
    return bool(k is not None and k.bf16_dot() and cpu_bf16.hardware_native())


def unavailable_reason() -> str | None:
    kernel()
    return _state.get("why")
