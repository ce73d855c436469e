"""The skinny GEMM (csrc/skinny_gemm.cpp): decode-sized linears, fp32 or bf16 weights.

Built and loaded by the one loader (engine/kernels/), like the attention kernels: once per
machine, `make` builds it during setup, compiled for this CPU and refused on a CPU that lacks
a feature it was compiled for. `kernel()` is None without a compiler, with PAGEDKV_LINEAR=torch
or after such a refusal; the linears then keep oneDNN / F.linear: slower at decode sizes, same results.
"""
from __future__ import annotations

from . import cpu_bf16
from .kernels import SKINNY_GEMM, trials

SOURCE = SKINNY_GEMM.spec.sources[0]
ACT = {"none": 0, "silu": 1}
BIN = {"none": 0, "mul": 1, "add": 2}

kernel = SKINNY_GEMM.get                       # the loaded module, or None (the reason in unavailable_reason())
unavailable_reason = SKINNY_GEMM.why


def bf16_pairs() -> bool:
    """Whether native bf16 can run the bf16 pair kernel (gemm_bf): the build has avx512_bf16
    (-march=native) and so does this CPU (the loader refuses a build for features this CPU lacks;
    this also covers PAGEDKV_BF16=native forced on a CPU without it), and gemm_bf passed its trial."""
    k = kernel()
    return bool(k is not None and trials.bf16_pairs(k).ok and cpu_bf16.hardware_native())


def for_linears():
    """The module where the linears may route decode sizes to it: loaded, and built with its AVX-512
    kernels (trials.skinny_vectorised: a build of the portable loops alone, as on an AVX2-only CPU, is
    right but slower than oneDNN there). None otherwise."""
    k = kernel()
    return k if k is not None and trials.skinny_vectorised(k).ok else None
