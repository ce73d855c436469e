"""Attention backends: torch reference (any device); device-specific ones plug in here."""
from .base import AttentionBackend
from .torch_ref import TorchPagedAttention


def get_backend(device_type: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    # The torch backend runs everywhere; fused NPU/CUDA kernels are selected here when present.
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionBackend", "TorchPagedAttention", "get_backend"]
