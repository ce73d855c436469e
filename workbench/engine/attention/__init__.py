"""Attention backends: torch reference (any device), CPU with a compiled paged decode kernel;
device-specific ones plug in here."""
from .base import AttentionBackend
from .cpu_paged import CpuPagedAttention
from .torch_fallback import TorchFallbackAttention
from .torch_ref import TorchPagedAttention


def get_backend(device_type: str, num_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int = 16) -> AttentionBackend:
    # A page size that is not a power of two has no paged kernel: the generic slow path
    # (field note 8). On CPU the compiled decode kernel when it builds (native.py says why
    # not), otherwise the torch backend, which runs everywhere; fused NPU/CUDA kernels are
    # selected here when present.
    if page_size < 1 or page_size & (page_size - 1):
        return TorchFallbackAttention(num_heads, num_kv_heads, head_dim)
    if device_type == "cpu":
        from . import native
        if native.kernel() is not None:
            return CpuPagedAttention(num_heads, num_kv_heads, head_dim)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionBackend", "CpuPagedAttention", "TorchFallbackAttention", "TorchPagedAttention",
           "get_backend"]
