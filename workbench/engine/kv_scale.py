"""Per-page scales for an fp16 KV cache (kv_cache_dtype="fp16_scaled").

Field note 5: some layers of a larger model have K/V beyond fp16's 65504; the cast
makes them inf and the model answers garbage. The fix reported: one scale per page
(per layer, for K and for V), absmax-based, stored with the page, applied on write
and undone on read (accuracy 63% -> 99.2%).

Scales are powers of two, chosen so a page's absmax is stored in [2^14, 2^15): far
below 65504 and far above fp16's subnormals. Powers of two make scaling exact, so
the only error is fp16's own rounding (<= 2^-11 of a value), and when a later token
of a partly filled page is larger, the page's earlier contents are rescaled by an
exact 2^-k: filling a page over many steps gives the same bits as writing it at once.

A page's previous contents are valid only if this step's writes to it start after
offset 0 (pages fill in order; a page written at offset 0 was just handed out), so
a reused page never inherits the scale of its previous owner.

The scales ride on the page tensor as attribute `page_scale` (see kv_cache.py), so
the attention backend receives them with the cache without an interface change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TARGET_EXP = 15          # stored page absmax in [2^(TARGET_EXP-1), 2^TARGET_EXP)
FP16_MAX = 65504.0


def page_scale(cache: torch.Tensor) -> torch.Tensor | None:
    """The [num_pages] float32 scales of a scaled page tensor, None for a plain one."""
    return getattr(cache, "page_scale", None)


def attach_scale(cache: torch.Tensor) -> torch.Tensor:
    """Give a page tensor [num_pages, ...] its per-page scales (all 1)."""
    cache.page_scale = torch.ones(cache.shape[0], dtype=torch.float32, device=cache.device)
    return cache


def pow2_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The power of two s with absmax / s in [2^14, 2^15) (1 for an all-zero page)."""
    _, e = torch.frexp(absmax.float() / 2.0 ** TARGET_EXP)
    return torch.ldexp(torch.ones_like(absmax, dtype=torch.float32), e)


@dataclass
class WritePlan:
    """Index work shared by every layer's K and V write in one step."""
    slots: torch.Tensor     # [T] slot of each token
    pages: torch.Tensor     # [P] distinct pages written
    inv: torch.Tensor       # [T] index into pages of each token's page
    fresh: torch.Tensor     # [P] bool: written from offset 0 (no earlier contents to keep)


def plan_write(slot_mapping: torch.Tensor, page_size: int) -> WritePlan:
    slots = slot_mapping.long()
    pages, inv = torch.unique(slots // page_size, return_inverse=True)
    first = torch.full(pages.shape, page_size, dtype=torch.long, device=slots.device)
    first.scatter_reduce_(0, inv, slots % page_size, "amin")
    return WritePlan(slots, pages, inv, first == 0)


def write_scaled(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, plan: WritePlan,
                 sync_free: bool | None = None) -> None:
    """Store x [T, H, D] at plan.slots of cache [N, ps, H, D] (fp16), updating the page scales.

    sync_free (default: off the CPU) rescales every written page instead of reading back
    which ones grew; both give the same cache."""
    n, _, h, d = cache.shape
    tok_max = x.abs().amax(dim=(1, 2)).float()
    need = torch.zeros(plan.pages.shape, dtype=torch.float32, device=x.device)
    need.scatter_reduce_(0, plan.inv, tok_max, "amax")
    old = scale.index_select(0, plan.pages)
    new = torch.where(plan.fresh, pow2_scale(need), torch.maximum(old, pow2_scale(need)))
    grown = ~plan.fresh & (new > old)
    flat = cache.view(n, -1)
    if sync_free is None:
        sync_free = x.device.type != "cpu"
    if not sync_free:               # a host sync is free on CPU: touch only the pages that grew (rare)
        sel = grown.nonzero().squeeze(1)
        pages, ratio = plan.pages.index_select(0, sel), (old / new).index_select(0, sel)
    else:                           # no sync on an accelerator: every page written, ratio 1 if unchanged
        pages, ratio = plan.pages, torch.where(grown, old / new, torch.ones_like(old))
    if pages.numel():
        # Exact: ratio is a power of two; existing contents move to the larger scale.
        flat.index_copy_(0, pages, (flat.index_select(0, pages).float() * ratio[:, None]).to(cache.dtype))
    vals = (x.float() / new.index_select(0, plan.inv)[:, None, None]).to(cache.dtype)
    cache.view(-1, h, d).index_copy_(0, plan.slots, vals)
    scale.index_copy_(0, plan.pages, new)


def unscale(pages_data: torch.Tensor, scale: torch.Tensor, pages: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Gathered pages [P, ...] (as stored) times their scales, in dtype (multiplied in fp32)."""
    s = scale.index_select(0, pages).view(-1, *([1] * (pages_data.dim() - 1)))
    return (pages_data.float() * s).to(dtype)
