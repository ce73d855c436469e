"""Attention backends: torch reference (any device), CPU with a compiled paged decode kernel,
npu on torch_npu's paged ops (a contract-checking CPU double stands in for them in tests)."""
from .base import AttentionBackend
from .cpu_paged import CpuPagedAttention
from .npu import NpuPagedAttention
from .torch_fallback import TorchFallbackAttention
from .torch_ref import TorchPagedAttention


def resolve_choice(device_type: str, choice: str = "auto") -> str:
    """The backend a choice names on a device type: "auto" on an NPU is "npu"; anything else stays
    as given (elsewhere get_backend decides "auto" from the page size and the compiled kernel)."""
    return "npu" if choice == "auto" and device_type == "npu" else choice


def npu_page_size_ok(page_size: int) -> bool:
    from ..config import NPU_BLOCK_SIZE_MAX
    return page_size % 16 == 0 and 16 <= page_size <= NPU_BLOCK_SIZE_MAX


def get_backend(device_type: str, num_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int = 16, choice: str = "auto") -> AttentionBackend:
    # A page size no paged kernel takes has the generic slow path (field note 8): not a power of
    # two for the CPU/CUDA kernels, not a multiple of 16 for torch_npu's ops (EngineConfig lets
    # one through only with allow_unsupported_page_size). On CPU the compiled decode kernel when
    # it builds (native.py says why not), otherwise the torch backend, which runs everywhere.
    choice = resolve_choice(device_type, choice)
    if choice == "npu":
        if not npu_page_size_ok(page_size):
            return TorchFallbackAttention(num_heads, num_kv_heads, head_dim)
        return NpuPagedAttention(num_heads, num_kv_heads, head_dim)
    if page_size < 1 or page_size & (page_size - 1):
        return TorchFallbackAttention(num_heads, num_kv_heads, head_dim)
    if choice == "torch":
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
    if device_type == "cpu" and choice in ("auto", "cpu"):
        from . import native
        if choice == "cpu" or native.kernel() is not None:
            return CpuPagedAttention(num_heads, num_kv_heads, head_dim)   # steps aside per step without a kernel
    if choice == "cpu":
        from ..config import ConfigError
        raise ConfigError(f"attention_backend='cpu' runs on the CPU only, not on device type {device_type!r}; "
                          f"use 'auto' or 'torch'")
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionBackend", "CpuPagedAttention", "NpuPagedAttention", "TorchFallbackAttention",
           "TorchPagedAttention", "get_backend", "resolve_choice"]
