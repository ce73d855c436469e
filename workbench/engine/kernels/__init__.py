"""Native kernels: one loader for every extension (loader.py), its cache keyed by sources,
compiler, torch, Python and the CPU features a build was compiled for (cache.py, cpu.py), and
the trials that confirm a path before it runs (trials.py). Which kernels an engine runs is
decided above this package and the backends it chooses between (engine/kernel_selection.py).

    extensions.ALL            the four extensions: attention, skinny_gemm, pool_ops, seq_ops
    Kernel.get() / why()      the module once per process, or None and why (a refusal included)
    cpu_features()            this CPU's ISA features; $PAGEDKV_CPU_FEATURES fakes another CPU
"""
from . import trials
from .cache import build_dir, cache_key, key_fields
from .cpu import cpu_features
from .extensions import ALL, ATTENTION, POOL_OPS, SEQ_OPS, SKINNY_GEMM
from .loader import Kernel, Refused
from .spec import Spec

__all__ = ["ALL", "ATTENTION", "trials", "POOL_OPS", "SEQ_OPS", "SKINNY_GEMM", "Kernel", "Refused", "Spec",
           "build_dir", "cache_key", "cpu_features", "key_fields"]
from . import ops  # noqa: E402,F401  registers torch.ops.pagedkv.paged_decode / paged_prefill
