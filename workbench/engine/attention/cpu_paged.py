"""CPU paged attention: compiled kernels for decode (pages read in place) and prefill (every chunk, one call).

Decode attention is memory-bound. The torch backend gathers each decode row's pages into
a fresh tensor and runs SDPA over it (write + read + read of the KV bytes); the kernel in
csrc/paged_decode.cpp walks the block table and reads each page once, as the paged
kernels of vLLM, FlashAttention and ATB do on their devices. Same contract, same plan,
same results (checked against dense attention in tests/test_attention.py).

Prefill (csrc/paged_prefill.cpp) runs every chunk of a step in one call, from the plan's
entries (NativePrefill below): ~1.7x torch's per-sequence SDPA at prefill-heavy sizes.

It reads float32 and bfloat16 pages (bf16 widened as loaded: half the bytes of a decode
step's KV traffic). A native-bf16 model on a CPU and a build with avx512_bf16 hands it bf16
rows (q|k|v as its GEMM wrote them, rotated in place by rope_write; the output in bf16), and
prefill takes its scores and P.V as bf16 pairs with float32 sums (vdpbf16ps): ~1.6x the
float32 dots; decode widens its few rows. It falls back to the torch path, per step, where the kernel does not
apply: a float16 or fp16_scaled cache, or a page_reader set through the backend's seam (a
fault emulating device memory, page_out_of_range unchecked): it must see every page read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import cpu_bf16, kv_scale
from ..batch import PackedBatch
from ..kernels import trials
from . import native
from .torch_ref import TorchPagedAttention


NATIVE_CACHE_DTYPES = (torch.float32, torch.bfloat16)   # what the kernel reads in place


@dataclass
class NativeDecode:
    tables: torch.Tensor     # the bound device block tables the kernel reads
    tok: torch.Tensor        # [Bd] int64: row of each decode query in the packed batch
    rows: torch.Tensor       # [Bd] int64: its row in the bound block table
    lens: torch.Tensor       # [Bd] int32: context length (tokens to attend over)
    _local: torch.Tensor | None = None

    @property
    def local(self) -> torch.Tensor:
        """0..Bd-1, the decode rows of a gathered query (bf16 compute): built once a step, not a layer."""
        if self._local is None:
            self._local = torch.arange(len(self.tok))
        return self._local


@dataclass
class NativePrefill:
    """The plan's prefill entries as the compiled prefill kernel takes them: one call a layer.

    Built from plan.prefill (the PrefillSeq entries the packing probe checks), so the kernel
    runs what the plan says: each entry's span and context, its own page list (row k of
    `tables` for chunk k), and its mask as a diagonal offset. An entry the kernel cannot
    express (a mask that is not a shifted causal one) stays in `rest`, for SDPA."""
    chunks: torch.Tensor     # [C, 6] int64: start, n, context, tables row, fresh 0/1, mask offset
    tables: torch.Tensor     # [C, W] int32: the pages each paged chunk reads (its entry's list)
    rest: list               # PrefillSeq entries SDPA runs
    bf16_dots: bool = False  # bf16 q / k / v / out, scores and P.V in bf16 pairs with float32 sums


def native_prefill_plan(seqs: list) -> NativePrefill | None:
    rows, tables, rest = [], [], []
    for s in seqs:
        n, c = s.end - s.start, s.context
        off = 0
        if n < 1 or c < n:                       # a malformed entry (a corrupted plan): SDPA does what it does
            rest.append(s)
            continue
        if s.pages is not None and s.mask is not None:
            m = s.mask.to("cpu").bool()
            off = int(m[0].sum()) - (c - n + 1)
            want = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None] + off
            if m.shape != want.shape or off <= -c or not torch.equal(m, want):
                rest.append(s)
                continue
        if s.pages is None and c != n:          # no pages to read the context from: SDPA does what it does
            rest.append(s)
            continue
        rows.append([s.start, n, c, len(rows), int(s.pages is None), off])
        tables.append(None if s.pages is None else s.pages.to("cpu", torch.int32))
    if not rows:
        return None
    table = torch.zeros(len(rows), max([1] + [len(t) for t in tables if t is not None]), dtype=torch.int32)
    for k, t in enumerate(tables):
        if t is not None:
            table[k, : len(t)] = t
    return NativePrefill(torch.tensor(rows, dtype=torch.int64), table, rest)


def prefill_bf16_dots(kernel=None) -> bool:
    """Whether the compiled prefill can take its dot products in bf16 pairs (vdpbf16ps): the build
    has avx512_bf16 (-march=native) and so does this CPU (a cached build can be another host's)."""
    kernel = native.kernel() if kernel is None else kernel
    return bool(kernel is not None and trials.prefill_bf16_dots(kernel).ok and cpu_bf16.hardware_native())


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.kernel = native.kernel()

    def _native_ok(self, batch: PackedBatch, q_dtype, cache) -> bool:
        # The kernel reads float32 pages in place from a table on the CPU; a page_reader (a fault
        # emulating device memory) must see every page read, so the kernel steps aside for it.
        return (self.kernel is not None and batch.block_tables.device.type == "cpu" and self.page_reader is None
                and q_dtype in (torch.float32, torch.bfloat16) and cache is not None
                and cache.dtype in NATIVE_CACHE_DTYPES and kv_scale.page_scale(cache) is None)

    def bf16_rows_ok(self, cache: torch.Tensor | None) -> bool:
        """Whether the compiled kernels take a native-bf16 model's bf16 rows over this cache: bf16
        pages, prefill's bf16 dots compiled in and on this CPU, a head size its pair tiles cover, and
        no page_reader (a fault seam: the kernels step aside for it, and then float32 attention is
        what runs, not torch's per-sequence bf16 SDPA)."""
        return (cache is not None and cache.dtype == torch.bfloat16 and self.head_dim in (64, 128)
                and self.page_reader is None and prefill_bf16_dots(self.kernel))

    def fused_rope_write(self, q_dtype, cache) -> bool:
        if q_dtype == torch.bfloat16:          # bf16 q|k|v rotated in place (the prefill then takes them)
            return super().fused_rope_write(torch.float32, cache) and self.bf16_rows_ok(cache)
        return super().fused_rope_write(q_dtype, cache)

    def plan(self, batch: PackedBatch, q_dtype: torch.dtype = torch.float32, cache: torch.Tensor | None = None):
        plan = super().plan(batch, q_dtype, cache)
        bf16 = q_dtype == torch.bfloat16 and self.bf16_rows_ok(cache)
        if (plan.prefill and (q_dtype == torch.float32 or bf16) and self._native_ok(batch, q_dtype, cache)
                and batch.page_size % 16 == 0 and hasattr(self.kernel, "paged_prefill")):
            plan.native_prefill = native_prefill_plan(plan.prefill)
            if plan.native_prefill is not None:
                plan.native_prefill.bf16_dots = bf16
        return plan

    def prefill_plan(self, q, k, v, k_cache, v_cache, plan, out: torch.Tensor) -> None:
        native = plan.native_prefill
        if native is None:
            return super().prefill_plan(q, k, v, k_cache, v_cache, plan, out)
        if k.stride(0) != v.stride(0) or k.stride(1) != k.shape[2]:   # unfused RoPE: k in a tensor of its own
            k, v = k.contiguous(), v.contiguous()
        self.kernel.paged_prefill(q, out, k, v, k_cache, v_cache, native.tables, native.chunks, self.scale,
                                  native.bf16_dots)
        self.prefill(q, k, v, k_cache, v_cache, native.rest, out)

    def plan_decode(self, batch: PackedBatch, rows_all: np.ndarray, q_dtype=None, cache=None) -> tuple[list, int]:
        if len(rows_all) == 0 or not self._native_ok(batch, q_dtype, cache):
            return super().plan_decode(batch, rows_all, q_dtype, cache)
        ctx, cu, ps = batch.context_lens_np, batch.cu_seqlens_q_np, batch.page_size
        lens = ctx[rows_all]
        plan = NativeDecode(batch.block_tables, torch.from_numpy(cu[rows_all].astype(np.int64)),
                            torch.from_numpy(rows_all.astype(np.int64)),
                            torch.from_numpy(lens.astype(np.int32)))
        return [plan], int((-(-lens // ps)).sum())

    def decode(self, q, k_cache, v_cache, groups: list, out: torch.Tensor) -> None:
        if groups and isinstance(groups[0], NativeDecode):
            if k_cache.dtype not in NATIVE_CACHE_DTYPES or kv_scale.page_scale(k_cache) is not None:
                raise RuntimeError(f"compiled decode planned for a float32 / bfloat16 cache; got {k_cache.dtype}")
            p = groups[0]
            if q.dtype == torch.float32:
                self.kernel.paged_decode(q, out, k_cache, v_cache, p.tables, p.tok, p.rows, p.lens, self.scale)
                return
            # bf16 compute (native bf16 CPUs): the kernel takes fp32 queries; widen the decode
            # rows only, and round their outputs back.
            qd = q.index_select(0, p.tok).float()
            od = torch.empty_like(qd)
            self.kernel.paged_decode(qd, od, k_cache, v_cache, p.tables, p.local, p.rows, p.lens,
                                     self.scale)
            out.index_copy_(0, p.tok, od.to(out.dtype))
            return
        super().decode(q, k_cache, v_cache, groups, out)
