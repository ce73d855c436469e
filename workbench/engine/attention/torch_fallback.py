"""The generic slow path a page size that is not a power of two falls back to.

Paged kernels (Ascend PagedAttention, FlashAttention's paged KV) need page_size a
power of two: the page and offset of a token are a shift and a mask. For any other
size, runtimes fall back to a generic path (field note 8: page_size 12 after an
upgrade, throughput 79 -> 42 tokens/s). This backend is that path, written the way
such fallbacks are:

- no per-step plan: every layer recomputes each token's slot from the block table
  (a real division and modulo by page_size);
- K/V gathered token by token through those slots (rows of Hkv x D, not whole pages),
  the whole context, even for a chunk whose K/V was just computed;
- decodes padded to the longest context of the step (no grouping by length);
- KV heads expanded to the query heads (no native GQA), scores materialised in fp32.

Results equal the paged path (up to float rounding); it just moves more bytes.
`bytes_moved` counts what it read from the cache plus its slot indices, so a test can
compare bytes per token with what the paged kernel reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kv_scale
from ..batch import PackedBatch
from .torch_ref import TorchPagedAttention


@dataclass
class FallbackPlan:
    pages_read: int          # the pages a paged kernel would read (for bandwidth accounting)
    scale_write: object = None   # fp16_scaled: the scaled write's page indices


class TorchFallbackAttention(TorchPagedAttention):
    name = "torch-fallback"
    query_chunk = 512            # prefill query rows per score matrix

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bytes_moved = 0     # cache bytes gathered + slot index bytes, all layers, since creation

    def plan(self, batch: PackedBatch, q_dtype=None, cache=None) -> FallbackPlan:
        # Only the accounting the engine reports: a paged kernel's page reads, so the
        # bandwidth probe sees the useful bytes and this path's extra work as lost time.
        ps, q, ctx = batch.page_size, batch.query_lens_np, batch.context_lens_np
        pages = -(-ctx // ps)
        useful = int(pages[q == 1].sum()) + int(pages[(q > 1) & (ctx > q)].sum())
        scale_write = None
        if cache is not None and kv_scale.page_scale(cache) is not None:
            scale_write = kv_scale.plan_write(batch.slot_mapping, cache.shape[1])
        return FallbackPlan(useful, scale_write)

    def fused_rope_write(self, q_dtype, cache) -> bool:
        return False                  # the generic path: no fused store either

    def _slots(self, bt_rows: torch.Tensor, lens: torch.Tensor, length: int, ps: int) -> torch.Tensor:
        """Slot of every position < length of each row; positions past a row's length
        repeat its last token (read, then masked away)."""
        pos = torch.arange(length, device=bt_rows.device)[None, :].expand(bt_rows.shape[0], -1)
        pos = torch.minimum(pos, (lens - 1)[:, None])
        page = torch.gather(bt_rows.long(), 1, torch.div(pos, ps, rounding_mode="floor"))
        return page * ps + torch.remainder(pos, ps)

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        flat = slots.reshape(-1)
        out = cache.view(-1, hkv, d).index_select(0, flat)
        self.bytes_moved += out.numel() * out.element_size() + slots.numel() * 8
        scale = kv_scale.page_scale(cache)
        if scale is not None:                       # fp16_scaled: undo each token's page scale
            out = kv_scale.unscale(out, scale, torch.div(flat, cache.shape[1], rounding_mode="floor"),
                                   torch.float32)
        g = self.num_heads // hkv
        # [rows, L, Hkv, D] -> [rows, Hq, L, D]: every query head gets its own copy.
        return out.view(*slots.shape, hkv, d).to(torch.float32).repeat_interleave(g, dim=2).transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        s = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.matmul(s.softmax(-1), v)

    def forward(self, q, k, v, k_cache, v_cache, batch: PackedBatch, plan: FallbackPlan | None = None) -> torch.Tensor:
        self._plan_of(batch, q.dtype, k_cache, plan)
        ps = batch.page_size
        bt = batch.block_tables
        dev = bt.device
        qlens, ctx, cu = batch.query_lens_np, batch.context_lens_np, batch.cu_seqlens_q_np
        out = torch.empty_like(q)
        hq, d = self.num_heads, self.head_dim

        dec = (qlens == 1).nonzero()[0]
        if len(dec):
            rows = torch.from_numpy(dec).to(dev)
            lens = torch.from_numpy(ctx[dec].astype(np.int64)).to(dev)
            length = int(ctx[dec].max())
            slots = self._slots(bt.index_select(0, rows), lens, length, ps)
            kd, vd = self._gather(k_cache, slots), self._gather(v_cache, slots)
            tok = torch.from_numpy(cu[dec].astype(np.int64)).to(dev)
            qd = q.index_select(0, tok).view(len(dec), hq, 1, d)
            allowed = (torch.arange(length, device=dev)[None, :] < lens[:, None])[:, None, None, :]
            o = self._attend(qd, kd, vd, allowed)
            out.index_copy_(0, tok, o.view(len(dec), hq, d).to(q.dtype))
        for i in (qlens > 1).nonzero()[0].tolist():
            a, b, c = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            n = b - a
            lens = torch.tensor([c], device=dev)
            slots = self._slots(bt[i:i + 1], lens, c, ps)
            ks, vs = self._gather(k_cache, slots), self._gather(v_cache, slots)
            for j in range(0, n, self.query_chunk):          # bound the materialised scores
                e = min(n, j + self.query_chunk)
                qs = q[a + j:a + e].transpose(0, 1)[None]                           # [1, Hq, e-j, D]
                allowed = (torch.arange(c, device=dev)[None, :]
                           <= torch.arange(c - n + j, c - n + e, device=dev)[:, None])
                out[a + j:a + e] = self._attend(qs, ks, vs, allowed)[0].transpose(0, 1).to(q.dtype)
        return out
