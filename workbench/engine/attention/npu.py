"""Ascend NPU attention on torch_npu's paged ops, called the way vllm-ascend calls them.

- K/V store: torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm") where torch_npu has
  it (vllm-ascend's A2/A3 path, vllm_ascend/device/device_op.py BaseDeviceAdaptor), else
  torch_npu._npu_reshape_and_cache (its 310P path); int32 slots, contiguous K/V.
- Decode rows (query length 1): torch_npu._npu_paged_attention over the
  [num_pages, page_size, Hkv, D] caches, an int32 block table and int32 context lengths
  (vllm_ascend/attention/attention_v1.py forward_paged_attention).
- Prefill, chunked prefill and prefix-cache hits: torch_npu.npu_fused_infer_attention_score
  in TND layout over the paged cache viewed [num_blocks, block_size, Hkv*D], with
  actual_seq_lengths cumulative (cu_seqlens_q without the 0), actual_seq_lengths_kv per
  sequence (vllm-ascend passes seq_lens_list when a block table is given), sparse_mode=3 and
  the 2048x2048 int8 triu mask (attention_v1.py _get_fia_params / forward_fused_infer_attention,
  attention_mask.py). Every chunk's K/V is in the pages by then (write_kv runs first), so
  one paged call covers a fresh prompt, a chunk after earlier chunks and a prefix-cache hit.
- A mixed step makes one decode call and one prefill call, the split vllm-ascend makes in
  _forward_fia_chunked_prefill_split: the prefill call takes its rows' lengths, rebased.

The plan (NpuPlan) holds the tensors and lists the ops get; the model keeps it on
batch.attn_plan, so the packing probe checks actual_seq_lengths(_kv) and, through the decode /
prefill views, the rows, lengths and pages each call reads.

The kernels read pages in place, so the page_reader seam cannot be honoured and is not:
a page id past the pool reaches the op as it would on the device, and the CPU double reads
it as device memory would (npu_double.OUT_OF_RANGE_FILL): the page_out_of_range fault
reproduces through the corrupted table alone.

torch_npu is imported when the backend is built, never at module import: on a machine without
it the constructor says to install torch_npu or set PAGEDKV_NPU_DOUBLE=1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batch import PackedBatch
from ..config import (NPU_BLOCK_SIZE_MAX, NPU_BLOCK_SIZE_MULTIPLE, NPU_DTYPES, NPU_HEAD_SIZE_MAX, ConfigError,
                      check_npu_head_size)
from .base import AttentionBackend

# What this backend accepts (EngineConfig checks them; kvwb doctor prints them).
ACCEPTED_DTYPES = NPU_DTYPES
BLOCK_SIZE_MULTIPLE = NPU_BLOCK_SIZE_MULTIPLE
MAX_BLOCK_SIZE = NPU_BLOCK_SIZE_MAX
MAX_HEAD_SIZE = NPU_HEAD_SIZE_MAX

MASK_SIZE = 2048        # sparse_mode 2/3/4 take the optimised 2048 x 2048 mask
_MASKS: dict = {}       # device -> that mask (read-only, shared by every backend)


def torch_npu_module():
    """torch_npu (real, or the CPU double where PAGEDKV_NPU_DOUBLE=1 / installed), else ConfigError."""
    from .. import device
    mod = device._import_torch_npu()
    if mod is None:
        raise ConfigError(
            "the npu attention backend needs torch_npu: install torch_npu (and CANN) on an Ascend machine, or set "
            "PAGEDKV_NPU_DOUBLE=1 to run the npu code path on the CPU through the contract-checking double of its "
            "ops (workbench/engine/attention/npu_double.py)")
    return mod


@dataclass
class NpuDecodeView:
    """The decode call as probes/plan_check.py reads a paged-kernel plan: row r of `tables`."""
    tables: torch.Tensor
    tok: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor


@dataclass
class NpuPrefillView:
    """One sequence of the prefill call as plan_check reads it: its span, context and pages."""
    start: int
    end: int
    context: int
    pages: torch.Tensor
    mask: None = None


@dataclass
class NpuPlan:
    slot_indices: torch.Tensor               # [T] int32: the K/V store's slots
    block_table: torch.Tensor                # [B, W] int32: the bound batch.block_tables
    actual_seq_lengths: list[int]            # [B] cumulative query ends of the batch (cu_seqlens_q[1:])
    actual_seq_lengths_kv: list[int]         # [B] context length of each sequence (paged TND: per sequence)
    decode_rows: np.ndarray                  # batch rows of the decode call
    decode_tok: torch.Tensor | None          # [Bd] int64: the packed row of each decode query
    decode_block_table: torch.Tensor | None  # [Bd, W] int32 (block_table itself when every row decodes)
    context_lens: torch.Tensor | None        # [Bd] int32, host (as vllm-ascend's seq_lens)
    prefill_rows: np.ndarray                 # batch rows of the prefill call
    prefill_tok: torch.Tensor | None         # [Tp] int64 packed rows of its queries; None: all, in order
    prefill_block_table: torch.Tensor | None
    prefill_seq_lengths: list[int] | None    # its actual_seq_lengths (the batch's when no row decodes)
    prefill_seq_lengths_kv: list[int] | None
    pages_read: int                          # pages the kernels read per layer (bandwidth accounting)
    cu: np.ndarray                           # the cu_seqlens_q the plan was made from (for the views)
    page_size: int

    def op_tables(self) -> list[tuple[str, torch.Tensor, np.ndarray]]:
        """(op, the block table it is given, the batch row of each of its rows): what the page-table
        probe checks, the tables as the kernels receive them (a mixed step gives each call its rows)."""
        out = []
        if self.decode_block_table is not None:
            out.append(("_npu_paged_attention", self.decode_block_table, self.decode_rows))
        if self.prefill_block_table is not None:
            out.append(("npu_fused_infer_attention_score", self.prefill_block_table, self.prefill_rows))
        return out

    @property
    def decode(self) -> list:
        if self.decode_tok is None:
            return []
        return [NpuDecodeView(self.block_table, self.decode_tok, torch.from_numpy(self.decode_rows), self.context_lens)]

    @property
    def prefill(self) -> list:
        if self.prefill_seq_lengths is None:
            return []
        ps = self.page_size
        out = []
        for k, r in enumerate(self.prefill_rows.tolist()):
            c = self.actual_seq_lengths_kv[r]
            out.append(NpuPrefillView(int(self.cu[r]), int(self.cu[r + 1]), c,
                                      self.prefill_block_table[k, :-(-c // ps)]))
        return out


class NpuPagedAttention(AttentionBackend):
    name = "npu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 kv_write: str = "auto"):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        check_npu_head_size(head_dim)
        if num_heads // num_kv_heads > 64:
            raise ConfigError(f"num_heads / num_kv_heads = {num_heads // num_kv_heads} cannot run on the npu attention "
                              f"backend: npu_fused_infer_attention_score takes a GQA group of at most 64")
        if kv_write not in ("auto", "scatter", "reshape_and_cache"):
            raise ValueError(f"kv_write={kv_write!r} is not one of auto, scatter, reshape_and_cache")
        self.ops = torch_npu_module()
        if kv_write == "auto":
            kv_write = "scatter" if hasattr(self.ops, "npu_scatter_pa_kv_cache") else "reshape_and_cache"
        self.kv_write = kv_write

    @staticmethod
    def causal_mask(device: torch.device) -> torch.Tensor:
        """vllm-ascend's splitfuse mask: 1 above the diagonal (masked), int8, built once per device."""
        m = _MASKS.get(device)
        if m is None:
            m = _MASKS[device] = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu_(1).to(torch.int8).to(device)
        return m

    # ---- planning (once per step) ------------------------------------------------
    def plan(self, batch: PackedBatch, q_dtype: torch.dtype | None = None, cache: torch.Tensor | None = None
             ) -> NpuPlan:
        bt = batch.block_tables
        if bt.dtype != torch.int32:
            raise RuntimeError(f"block_tables has dtype {bt.dtype}: torch_npu's paged ops take int32 block tables")
        qlens, ctx, cu, ps = batch.query_lens_np, batch.context_lens_np, batch.cu_seqlens_q_np, batch.page_size
        dev, b = bt.device, len(qlens)
        asl, askv = cu[1:].tolist(), ctx.tolist()
        dec, pre = np.nonzero(qlens == 1)[0], np.nonzero(qlens != 1)[0]
        d_tok = d_table = d_lens = p_tok = p_table = p_len = p_kv = None
        if len(dec):
            d_tok = torch.from_numpy(cu[dec].astype(np.int64)).to(dev)
            d_table = bt if len(dec) == b else bt.index_select(0, torch.from_numpy(dec).to(dev))
            d_lens = torch.from_numpy(ctx[dec].astype(np.int32))
        if len(pre) == b:                                   # no decode row: the batch's own lists
            p_table, p_len, p_kv = bt, asl, askv
        elif len(pre):
            starts, n = cu[pre].astype(np.int64), (cu[pre + 1] - cu[pre]).astype(np.int64)
            ends = np.cumsum(n)                             # rebased: the call's own cumulative ends
            off = np.repeat(starts - (ends - n), np.maximum(n, 0))
            p_tok = torch.from_numpy(off + np.arange(len(off))).to(dev)
            p_table = bt.index_select(0, torch.from_numpy(pre).to(dev))
            p_len, p_kv = ends.tolist(), ctx[pre].tolist()
        return NpuPlan(batch.slot_mapping.to(torch.int32), bt, asl, askv, dec, d_tok, d_table, d_lens, pre, p_tok,
                       p_table, p_len, p_kv, int((-(-ctx // ps)).sum()), cu.copy(), ps)

    # ---- K/V store ------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, batch: PackedBatch, plan: NpuPlan | None = None) -> None:
        plan = self._plan_of(batch, k.dtype, k_cache, plan)
        key, value = k.contiguous(), v.contiguous()        # both ops take contiguous K/V (vllm-ascend: .contiguous())
        if self.kv_write == "scatter":
            self.ops.npu_scatter_pa_kv_cache(key, value, k_cache, v_cache, plan.slot_indices, cache_mode="Norm")
        else:
            self.ops._npu_reshape_and_cache(key, value, k_cache, v_cache, plan.slot_indices)

    # ---- compute -------------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, batch: PackedBatch, plan: NpuPlan | None = None) -> torch.Tensor:
        plan = self._plan_of(batch, q.dtype, k_cache, plan)
        out = None
        if plan.prefill_seq_lengths is not None:
            nb, bs = k_cache.shape[:2]
            query = q.contiguous() if plan.prefill_tok is None else q.index_select(0, plan.prefill_tok)
            o, _ = self.ops.npu_fused_infer_attention_score(
                query, k_cache.view(nb, bs, -1), v_cache.view(nb, bs, -1), atten_mask=self.causal_mask(q.device),
                block_table=plan.prefill_block_table, input_layout="TND", block_size=bs,
                actual_seq_lengths=plan.prefill_seq_lengths, actual_seq_lengths_kv=plan.prefill_seq_lengths_kv,
                num_key_value_heads=self.num_kv_heads, num_heads=self.num_heads, scale=self.scale, sparse_mode=3)
            if plan.decode_tok is None and plan.prefill_tok is None:
                return o                                    # the whole batch, in order
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            out.index_copy_(0, plan.prefill_tok, o)
        if plan.decode_tok is not None:
            query = q.index_select(0, plan.decode_tok)     # [Bd, Hq, D], contiguous
            o = torch.empty_like(query)
            self.ops._npu_paged_attention(query, k_cache, v_cache, self.num_kv_heads, self.num_heads, self.scale,
                                          plan.decode_block_table, plan.context_lens, o)
            if out is None:
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            out.index_copy_(0, plan.decode_tok, o)
        return out
