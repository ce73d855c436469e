"""KV cache tensors: per layer, K and V as [num_pages, page_size, num_kv_heads, head_dim]."""
from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
    """Bytes one page costs across all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.dtype = dtype
        self.num_pages, self.page_size = num_pages, page_size
        self.bytes_per_page = page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages
