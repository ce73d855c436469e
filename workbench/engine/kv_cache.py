"""KV cache tensors: per layer, K and V as [num_pages, page_size, num_kv_heads, head_dim]."""
from __future__ import annotations

import torch

from . import hugepages as _hugepages
from .kv_scale import attach_scale

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
    """Bytes one page costs across all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, scaled: bool = False,
                 hugepages: str | None = None):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # On a CPU in 2 MiB pages (hugepages.py; EngineConfig.hugepages="off": torch.zeros): decode
        # reads pages scattered through the pool.
        self.k = [_hugepages.zeros(shape, dtype, device, hugepages) for _ in range(num_layers)]
        self.v = [_hugepages.zeros(shape, dtype, device, hugepages) for _ in range(num_layers)]
        self.dtype = dtype
        self.num_pages, self.page_size = num_pages, page_size
        self.bytes_per_page = page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)
        # fp16_scaled: one float32 scale per page, layer, K and V (kv_scale.py), carried by
        # each page tensor as .page_scale so backends get it with the cache.
        self.scaled = scaled
        if scaled:
            for t in self.k + self.v:
                attach_scale(t)
            self.bytes_per_page += 2 * num_layers * 4

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K scales, V scales) [num_pages] of a layer, or None when the cache is not scaled."""
        return (self.k[layer].page_scale, self.v[layer].page_scale) if self.scaled else None

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages
