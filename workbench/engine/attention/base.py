"""The attention backend interface every device implementation follows.

KV caches are per layer [num_pages, page_size, num_kv_heads, head_dim], the layout
that flash_attn_with_kvcache and torch_npu's paged attention take.
"""
from __future__ import annotations

import torch

from ..batch import PackedBatch


class AttentionBackend:
    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: PackedBatch) -> None:
        """Store this step's K/V [T, Hkv, D] at batch.slot_mapping."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Causal attention of packed queries q [T, Hq, D] over each sequence's paged context."""
        raise NotImplementedError
