"""Reading one request's K/V out of a vLLM attention layer's KV cache tensor, per backend.

The cache the kernel gets is `[blocks, Hkv, block_size, 2 * D]` on every backend we know, but
what sits where inside a block differs:

  CPU_ATTN (CPUAttentionBackendImpl)   each (block, head) is a K region of block_size * D
      elements and then a V region, each packed for the kernel's ISA (AMX's VNNI tiles, the
      vec kernels' column-major K, ...). The packing is learned, not assumed: the first time a
      (isa, dtype, block size, D) is met, vLLM's own `cpu_attn_reshape_and_cache` writes known
      small integers (each token's index, then each dimension's) into a scratch block, and the
      positions they land at are the gather that undoes the packing (checked to be a bijection).
  FLASH_ATTN (FlashAttentionImpl)      each token is a plain [K | V] row: `kv_cache.transpose(1, 2)
      .split(D, -1)` gives [blocks, block_size, Hkv, D] each (source-checked only: no CUDA here).

Any other backend is not read (the status line names it). fp8 caches are not read either.
"""
from __future__ import annotations

import torch

SUPPORTED = {"CPUAttentionBackendImpl": "cpu", "FlashAttentionImpl": "flash"}


def layout_of(impl) -> tuple[str | None, str]:
    """(layout, why not) for a backend implementation."""
    name = type(impl).__name__
    if str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        return None, f"{name} with an fp8 KV cache (not read: quantized)"
    for cls in type(impl).__mro__:
        if cls.__name__ in SUPPORTED:
            return SUPPORTED[cls.__name__], ""
    return None, f"{name}: its KV cache layout is not known to the plugin"


class CpuPacking:
    """The CPU backend's per-ISA packing of a (block, head) page, learned from vLLM's own write."""

    def __init__(self):
        self._perm: dict = {}

    def perms(self, isa: str, dtype, bs: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (isa, dtype, bs, d)
        if key not in self._perm:
            self._perm[key] = self._learn(isa, dtype, bs, d)
        return self._perm[key]

    @staticmethod
    def _learn(isa: str, dtype, bs: int, d: int):
        from vllm import _custom_ops as ops
        page = torch.zeros(1, 1, 2 * bs, d, dtype=dtype)
        kc, vc = page.chunk(2, dim=2)
        slots = torch.arange(bs, dtype=torch.int64)
        coord = {}
        # each coordinate written as base-128 digits: small integers every float dtype holds exactly
        for axis, n in (("t", bs), ("d", d)):
            val = torch.zeros(page.numel())
            scale = 1
            while scale < n:
                idx = torch.arange(n)
                digit = (idx // scale) % 128
                x = (digit[:, None, None].expand(bs, 1, d) if axis == "t" else digit[None, None, :].expand(bs, 1, d))
                x = x.to(dtype).contiguous()
                page.zero_()
                ops.cpu_attn_reshape_and_cache(x, x.clone(), kc, vc, slots, isa)
                val += page.reshape(-1).float() * scale
                scale *= 128
            coord[axis] = val.long()
        t, dd = coord["t"], coord["d"]
        perms = []
        for region in (0, 1):                          # K, then V
            lo = region * bs * d
            flat = t[lo: lo + bs * d] * d + dd[lo: lo + bs * d]            # (token, dim) at each element
            perm = torch.full((bs * d,), -1, dtype=torch.long)
            perm[flat] = torch.arange(bs * d)
            if bool((perm < 0).any()) or len(torch.unique(flat)) != bs * d:
                raise RuntimeError(f"the CPU KV cache packing for isa {isa}, block size {bs}, head size {d} "
                                   f"is not a permutation of its tokens and dims")
            perms.append(perm)
        return perms[0], perms[1]


PACKING = CpuPacking()


def read_kv(layout: str, kv_cache: torch.Tensor, blocks: list[int], *, isa: str | None = None,
            head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every slot of these kernel blocks, in order: [len(blocks) * block_size, Hkv, D] each."""
    idx = torch.as_tensor(blocks, dtype=torch.long, device=kv_cache.device)
    nb, hkv, bs, two_d = kv_cache.shape
    d = head_size
    x = kv_cache.index_select(0, idx)
    n = len(blocks)
    if layout == "flash":
        x = x.transpose(1, 2)                                     # [n, bs, Hkv, 2D]
        return x[..., :d].reshape(n * bs, hkv, d), x[..., d:].reshape(n * bs, hkv, two_d - d)
    if layout != "cpu":
        raise ValueError(f"unknown KV cache layout {layout!r}")
    if two_d != 2 * d:
        raise ValueError(f"CPU KV cache block of {two_d} per token, not 2 x head size {d}")
    pk, pv = PACKING.perms(isa, kv_cache.dtype, bs, d)
    x = x.reshape(n, hkv, 2, bs * d)
    # advanced indexing, not index_select along the last dim: ~5x faster on CPU for these shapes
    k = x[:, :, 0][..., pk.to(x.device)].view(n, hkv, bs, d)
    v = x[:, :, 1][..., pv.to(x.device)].view(n, hkv, bs, d)
    return k.permute(0, 2, 1, 3).reshape(n * bs, hkv, d), v.permute(0, 2, 1, 3).reshape(n * bs, hkv, d)
