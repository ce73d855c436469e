"""The attention backend interface every device implementation follows.

KV caches are per layer [num_pages, page_size, num_kv_heads, head_dim], the layout
that flash_attn_with_kvcache and torch_npu's paged attention take.

One step: the model asks the backend for a plan once (plan(batch, q_dtype, cache): the
index tensors every layer reuses), keeps it on the batch for observers (batch.attn_plan)
and hands it to write_kv and forward of every layer.

Two seams, so a fault (or a test) changes behaviour through the interface instead of
the engine guessing what was patched:
- page_reader: when set, a callable (cache, pages, rows, dtype) -> [rows, W*ps, Hkv, D]
  that every page read goes through (a fault emulating device memory); backends that
  read pages in place (a compiled kernel) step aside for it;
- fuse_rope_write: False turns off a backend's fused RoPE + K/V store, so every K/V
  write goes through write_kv.
"""
from __future__ import annotations

import torch

from ..batch import PackedBatch


class AttentionBackend:
    name = "base"
    page_reader = None          # seam: a replacement for every page read (see the module docstring)
    FAULT_SEAMS = frozenset({"page_reader"})   # what Fault.patch may replace (page_out_of_range)
    fuse_rope_write = True      # seam: allow the fused RoPE + K/V store where the backend has one

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    def plan(self, batch: PackedBatch, q_dtype: torch.dtype, cache: torch.Tensor) -> object:
        """The step's index plan (shared by all layers); it has `pages_read` per layer."""
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: PackedBatch, plan: object = None) -> None:
        """Store this step's K/V [T, Hkv, D] at batch.slot_mapping."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: PackedBatch, plan: object = None) -> torch.Tensor:
        """Causal attention of packed queries q [T, Hq, D] over each sequence's paged context."""
        raise NotImplementedError

    def fused_rope_write(self, q_dtype: torch.dtype, cache: torch.Tensor) -> bool:
        """Whether rope_write() runs for these dtypes and caches (then write_kv does not)."""
        return False

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, batch: PackedBatch) -> bool | None:
        """Rotate q|k of qkv [T, (Hq + 2 Hkv) * D] in place and store k, v at their slots. Where
        batch.kv_absmax is set (the model's hooks want each row's max |K|, |V|), a backend may fill
        it in the same pass and return True; anything else (None) and the hooks measure K and V."""
        raise NotImplementedError

    def _plan_of(self, batch: PackedBatch, q_dtype, cache, plan):
        """The plan given, or (for direct callers) one made now and kept on the batch."""
        if plan is None:
            plan = batch.attn_plan
            if plan is None:
                plan = batch.attn_plan = self.plan(batch, q_dtype, cache)
        return plan
