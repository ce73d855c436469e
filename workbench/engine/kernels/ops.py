"""The compiled attention kernels as torch.library custom ops: pagedkv::paged_decode, pagedkv::paged_prefill.

The kernels (attention/csrc/paged_decode.cpp) write their result into `out`; as custom ops that mutation is
in the schema (mutates_args), and each has a fake implementation, so FakeTensor tracing and torch.compile
see what they do without running them. torch.library.opcheck checks both against the real kernels
(tests/test_kernel_ops.py). The CPU backend still calls the extension directly (attention/cpu_paged.py):
through the dispatcher a Python custom op costs ~33 us more a call (benchmarks/kernel_op_overhead.py).
With no compiled kernel on this machine the ops exist but raise on a real call, naming why; the engine
never plans them then (KernelSelection says the torch path runs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .extensions import ATTENTION


def _kernel():
    k = ATTENTION.get()
    if k is None:
        raise RuntimeError(f"pagedkv kernels are not built for this machine: {ATTENTION.why()}")
    return k


@torch.library.custom_op("pagedkv::paged_decode", mutates_args=("out",), device_types="cpu")
def paged_decode(q: Tensor, out: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, tok: Tensor,
                 rows: Tensor, lens: Tensor, scale: float) -> None:
    """Decode attention over pages read in place: for each decode query i (packed row tok[i]), its
    context of lens[i] tokens through block-table row rows[i]; float32 q / out, float32 or bf16 pages."""
    _kernel().paged_decode(q, out, k_cache, v_cache, tables, tok, rows, lens, scale)


@paged_decode.register_fake
def _(q, out, k_cache, v_cache, tables, tok, rows, lens, scale) -> None:
    return None


@torch.library.custom_op("pagedkv::paged_prefill", mutates_args=("out",), device_types="cpu")
def paged_prefill(q: Tensor, out: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                  tables: Tensor, chunks: Tensor, scale: float, bf16_dots: bool = False) -> None:
    """Causal prefill attention of every chunk of a step (fresh rows k / v, earlier context from the pages)."""
    _kernel().paged_prefill(q, out, k, v, k_cache, v_cache, tables, chunks, scale, bf16_dots)


@paged_prefill.register_fake
def _(q, out, k, v, k_cache, v_cache, tables, chunks, scale, bf16_dots=False) -> None:
    return None
