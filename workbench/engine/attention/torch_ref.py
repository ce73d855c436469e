"""Reference paged attention in plain torch: runs on any device.

Writes K/V by slot mapping (one index_copy_), then
- decodes (one query token) in batched calls over gathered pages, grouped by context
  length so padding to the longest member wastes little, masked by length;
- prefill chunks one sequence at a time (a loop over sequences, never tokens): a
  chunk that starts at position 0 attends to its own fresh K/V, a chunk after a
  prefix-cache hit or an earlier chunk reads its context from the pages.
Index tensors are planned once per step (plan()) and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .. import kv_scale
from ..batch import PackedBatch
from . import native
from .base import AttentionBackend


@dataclass
class DecodeGroup:
    tok: torch.Tensor            # [Bd] row of each query token in the packed batch
    pages: torch.Tensor          # [Bd * W] page ids read, row-major
    mask: torch.Tensor | None    # [Bd, 1, 1, W*ps] key validity, None when all full
    num_rows: int
    width: int                   # pages per row


@dataclass
class PrefillSeq:
    start: int
    end: int
    context: int
    pages: torch.Tensor | None   # page ids read; None when the chunk is the whole context
    mask: torch.Tensor | None


@dataclass
class AttentionPlan:
    decode: list                 # DecodeGroup (torch) or one NativeDecode (compiled CPU kernel)
    prefill: list[PrefillSeq]
    pages_read: int              # pages the kernel reads per layer (for bandwidth accounting)
    scale_write: object = None   # fp16_scaled: the scaled write's page indices (kv_scale.WritePlan)
    native_prefill: object = None  # cpu backend: the prefill entries its compiled kernel runs (NativePrefill)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, batch: PackedBatch, plan: AttentionPlan | None = None) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        slots = batch.slot_mapping
        if kv_scale.page_scale(k_cache) is not None:      # fp16_scaled: a scale per page
            plan = self._plan_of(batch, k.dtype, k_cache, plan)
            kv_scale.write_scaled(k, k_cache, k_cache.page_scale, plan.scale_write)
            kv_scale.write_scaled(v, v_cache, v_cache.page_scale, plan.scale_write)
            return
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))

    def fused_rope_write(self, q_dtype, cache) -> bool:
        # The compiled pass rotates float32 q|k and stores a plain row per slot: the layout
        # contract of an unscaled float32 or bfloat16 cache on the CPU, with float32 compute.
        return (self.fuse_rope_write and cache.device.type == "cpu" and q_dtype == torch.float32
                and cache.dtype in (torch.float32, torch.bfloat16) and cache.is_contiguous()
                and kv_scale.page_scale(cache) is None and native.kernel() is not None)

    def rope_write(self, qkv, cos, sin, k_cache, v_cache, batch: PackedBatch) -> bool:
        # batch.kv_absmax: the kernel measures each row's max |k|, |v| while the row is in L1
        # (float32 rows only); True when it did
        out = batch.kv_absmax if qkv.dtype == torch.float32 else None
        native.kernel().rope_write(qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, self.num_heads,
                                   self.num_kv_heads, out, batch.kv_layer)
        return out is not None

    # ---- planning (once per step) ------------------------------------------
    def plan(self, batch: PackedBatch, q_dtype: torch.dtype = torch.float32,
             cache: torch.Tensor | None = None) -> AttentionPlan:
        qlens, ctx, cu = batch.query_lens_np, batch.context_lens_np, batch.cu_seqlens_q_np
        ps = batch.page_size
        bt = batch.block_tables
        dev = bt.device
        prefill = []
        decode, pages_read = self.plan_decode(batch, (qlens == 1).nonzero()[0], q_dtype, cache)
        for i in (qlens > 1).nonzero()[0].tolist():
            a, b = int(cu[i]), int(cu[i + 1])
            n, c = b - a, int(ctx[i])
            if c == n:
                prefill.append(PrefillSeq(a, b, c, None, None))
                continue
            w = -(-c // ps)
            mask = (torch.arange(c, device=dev)[None, :] <= torch.arange(c - n, c, device=dev)[:, None])
            prefill.append(PrefillSeq(a, b, c, bt[i, :w].long(), mask))
            pages_read += w
        scale_write = None
        if cache is not None and kv_scale.page_scale(cache) is not None:
            scale_write = kv_scale.plan_write(batch.slot_mapping, cache.shape[1])
        return AttentionPlan(decode, prefill, pages_read, scale_write)

    def plan_decode(self, batch: PackedBatch, rows_all: np.ndarray, q_dtype=None, cache=None) -> tuple[list, int]:
        """Decode rows in groups of similar length: pages to gather and the padding mask."""
        ctx, cu, ps, bt = batch.context_lens_np, batch.cu_seqlens_q_np, batch.page_size, batch.block_tables
        dev = bt.device
        decode, pages_read = [], 0
        for rows in self.decode_groups(ctx, rows_all, ps):
            c = ctx[rows]
            w = int(-(-c.max() // ps))
            rows_t = torch.from_numpy(rows).to(dev)
            pages = bt.index_select(0, rows_t)[:, :w].reshape(-1).long()
            mask = None
            if not (c == w * ps).all():
                lens = torch.from_numpy(c).to(dev)
                mask = (torch.arange(w * ps, device=dev)[None, :] < lens[:, None])[:, None, None, :]
            tok = torch.from_numpy(cu[rows].astype(np.int64)).to(dev)
            decode.append(DecodeGroup(tok, pages, mask, len(rows), w))
            pages_read += len(rows) * w
        return decode, pages_read

    @staticmethod
    def decode_groups(ctx: np.ndarray, decode: np.ndarray, ps: int, min_fill: float = 0.5) -> list[np.ndarray]:
        """Split decode rows into groups of similar context length, so padding each group
        to its longest member wastes at most ~(1 - min_fill) of the pages read."""
        if len(decode) == 0:
            return []
        order = decode[np.argsort(-ctx[decode], kind="stable")]
        groups, start = [], 0
        longest = ctx[order[0]]
        for j in range(1, len(order)):
            if ctx[order[j]] < longest * min_fill and ctx[order[j]] > ps:
                groups.append(order[start:j])
                start, longest = j, ctx[order[j]]
        groups.append(order[start:])
        return groups

    def read_pages(self, cache: torch.Tensor, pages: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Every page read of this backend: the page_reader seam when one is set, else gather()."""
        reader = self.page_reader
        return self.gather(cache, pages, rows, dtype) if reader is None else reader(cache, pages, rows, dtype)

    def gather(self, cache: torch.Tensor, pages: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The pages a kernel reads, as [rows, W*page_size, Hkv, D].

        One index_select of whole pages (contiguous rows): ~3x faster on CPU than
        advanced indexing for decode-sized gathers.
        """
        n_pages = cache.shape[0]
        out = cache.view(n_pages, -1).index_select(0, pages)
        scale = kv_scale.page_scale(cache)
        if scale is not None:                              # fp16_scaled: undo each page's scale
            return kv_scale.unscale(out, scale, pages, dtype).view(rows, -1, self.num_kv_heads, self.head_dim)
        return out.view(rows, -1, self.num_kv_heads, self.head_dim).to(dtype)

    # ---- compute ---------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, batch: PackedBatch, plan: AttentionPlan | None = None) -> torch.Tensor:
        plan = self._plan_of(batch, q.dtype, k_cache, plan)
        out = torch.empty_like(q)
        self.decode(q, k_cache, v_cache, plan.decode, out)
        self.prefill_plan(q, k, v, k_cache, v_cache, plan, out)
        return out

    def prefill_plan(self, q, k, v, k_cache, v_cache, plan: AttentionPlan, out: torch.Tensor) -> None:
        """The step's prefill entries (a backend with a prefill kernel of its own overrides this)."""
        self.prefill(q, k, v, k_cache, v_cache, plan.prefill, out)

    def decode(self, q, k_cache, v_cache, groups: list, out: torch.Tensor) -> None:
        hkv, d, hq = self.num_kv_heads, self.head_dim, self.num_heads
        g = hq // hkv
        for grp in groups:
            # GQA: the G query heads of each KV head ride on the query-length axis.
            kd = self.read_pages(k_cache, grp.pages, grp.num_rows, q.dtype).transpose(1, 2)   # [Bd, Hkv, L, D]
            vd = self.read_pages(v_cache, grp.pages, grp.num_rows, q.dtype).transpose(1, 2)
            qd = q.index_select(0, grp.tok).view(grp.num_rows, hkv, g, d)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask, scale=self.scale)
            out.index_copy_(0, grp.tok, o.reshape(grp.num_rows, hq, d))

    def prefill(self, q, k, v, k_cache, v_cache, seqs: list[PrefillSeq], out: torch.Tensor) -> None:
        for s in seqs:
            # 4-D [1, H, n, D]: torch's CPU flash kernel takes only 4-D inputs; 3-D falls
            # back to the math path, 3-12x slower at prefill lengths.
            qs = q[s.start:s.end].transpose(0, 1)[None]                                   # [1, Hq, n, D]
            if s.pages is None:        # the whole context is in this chunk: no page read needed
                ks, vs = k[s.start:s.end].transpose(0, 1)[None], v[s.start:s.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:                      # bottom-right aligned causal mask over the paged context
                ks = self.read_pages(k_cache, s.pages, 1, q.dtype)[:, :s.context].transpose(1, 2)
                vs = self.read_pages(v_cache, s.pages, 1, q.dtype)[:, :s.context].transpose(1, 2)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=self.scale,
                                                   enable_gqa=True)
            out[s.start:s.end] = o[0].transpose(0, 1)
