"""Reference paged attention in plain torch: runs on any device.

Writes K/V by slot mapping (one index_copy_), then
- decodes (one query token) in one batched call over gathered pages, masked by length;
- prefill chunks one sequence at a time (a loop over sequences, never tokens): a
  chunk that starts at position 0 attends to its own fresh K/V, a chunk after a
  prefix-cache hit or an earlier chunk reads its context from the pages.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import PackedBatch
from .base import AttentionBackend


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, batch: PackedBatch) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        slots = batch.slot_mapping
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))

    def gather(self, cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pages of each row of block_tables, as [B, W*page_size, Hkv, D] (what the kernel reads)."""
        b, w = block_tables.shape
        return cache[block_tables.long()].reshape(b, w * cache.shape[1], self.num_kv_heads,
                                                  self.head_dim).to(dtype)

    def forward(self, q, k, v, k_cache, v_cache, batch: PackedBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        qlens, ctx, cu = batch.query_lens_np, batch.context_lens_np, batch.cu_seqlens_q_np
        ps = k_cache.shape[1]
        decode = (qlens == 1).nonzero()[0]
        if len(decode):
            self._decode(q, k_cache, v_cache, batch, decode, ps, out)
        for i in (qlens > 1).nonzero()[0].tolist():
            a, b = int(cu[i]), int(cu[i + 1])
            n, c = b - a, int(ctx[i])
            qs = q[a:b].transpose(0, 1)                                    # [Hq, n, D]
            if c == n:   # the whole context is in this chunk: no page read needed
                ks, vs = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                w = -(-c // ps)
                bt = batch.block_tables[i:i + 1, :w]
                ks = self.gather(k_cache, bt, q.dtype)[0, :c].transpose(0, 1)   # [Hkv, c, D]
                vs = self.gather(v_cache, bt, q.dtype)[0, :c].transpose(0, 1)
                # bottom-right aligned causal mask: query j sits at position c - n + j
                mask = (torch.arange(c, device=q.device)[None, :]
                        <= torch.arange(c - n, c, device=q.device)[:, None])
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, batch, rows, ps, out) -> None:
        ctx = batch.context_lens_np[rows]
        w = int(-(-ctx.max() // ps))
        rows_t = torch.from_numpy(rows).to(q.device)
        tok = torch.from_numpy(batch.cu_seqlens_q_np[rows]).to(q.device).long()
        bt = batch.block_tables.index_select(0, rows_t)[:, :w]
        kd = self.gather(k_cache, bt, q.dtype).transpose(1, 2)            # [Bd, Hkv, L, D]
        vd = self.gather(v_cache, bt, q.dtype).transpose(1, 2)
        lens = batch.context_lens.index_select(0, rows_t)
        mask = torch.arange(w * ps, device=q.device)[None, :] < lens[:, None]   # [Bd, L]
        qd = q.index_select(0, tok).unsqueeze(2)                         # [Bd, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)
        out.index_copy_(0, tok, o.squeeze(2))
