"""The engine's four native extensions: every one is built and loaded by loader.Kernel.

The flags are part of each build's key. The C++ kernels are compiled for this CPU
(-march=native: avx512 / avx512_bf16 where the CPU has them), so their manifests list its
features; the C loops are portable (no -march) and load on any x86-64 / arm64 host.
"""
from __future__ import annotations

from . import trials
from .cpu import X86
from .loader import Kernel
from .spec import ATTENTION_CSRC, CSRC, Spec

# 512-bit vectors: g++ prefers 256 on these cores, and the kernels' loops are bound by loads
# and FMAs, not by the clock drop that preference guards against.
NATIVE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")
NATIVE_LDFLAGS = ("-fopenmp",)
C_FLAGS = ("-O2",)

ATTENTION = Kernel(Spec("pagedkv_paged_decode",         # one module; the bindings are in paged_decode.cpp
                        (ATTENTION_CSRC / "paged_decode.cpp", ATTENTION_CSRC / "paged_prefill.cpp"),
                        "compiled CPU attention", flags=NATIVE_FLAGS, ldflags=NATIVE_LDFLAGS,
                        switch=("PAGEDKV_ATTENTION", "torch"), machines=X86),
                   fallback="the torch attention", trial=trials.attention)
SKINNY_GEMM = Kernel(Spec("pagedkv_skinny_gemm", (CSRC / "skinny_gemm.cpp",), "compiled skinny GEMM",
                          flags=NATIVE_FLAGS, ldflags=NATIVE_LDFLAGS, switch=("PAGEDKV_LINEAR", "torch"),
                          machines=X86),
                     fallback="oneDNN / F.linear", trial=trials.skinny_gemm)
POOL_OPS = Kernel(Spec("pagedkv_pool_ops", (CSRC / "pool_ops.c",), "compiled page-pool loops", kind="c",
                       flags=C_FLAGS, headers=(), switch=("PAGEDKV_POOL", "python")), fallback="the Python loops",
                  trial="workbench.engine.pool_ops:trial")      # against the Python reference, which lives there
SEQ_OPS = Kernel(Spec("pagedkv_seq_ops", (CSRC / "seq_ops.c",), "compiled sequence loops", kind="c",
                      flags=C_FLAGS, headers=(), switch=("PAGEDKV_POOL", "python")), fallback="the Python loops",
                 trial="workbench.engine.seq_ops:trial")

ALL = {"attention": ATTENTION, "skinny_gemm": SKINNY_GEMM, "pool_ops": POOL_OPS, "seq_ops": SEQ_OPS}
