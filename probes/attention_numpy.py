"""The attention check's clean path (attention_check.py) in numpy: the same three errors, cheaper.

The check runs inside the forward, right after a layer's attention, when the CPU's caches hold the
layer's weights: each of the ~70 small torch ops of the torch check pays a cold dispatch there
(~8 us against ~2 us warm), and a decode row's whole check cost ~1 ms. numpy's small ops cost a
fraction of that (a decode row's write and read errors: 160 us cold against 560 us in torch, on
the Intel host; its two matrix products go through torch, see attend()). So every check is first
computed here; the torch check (AttentionCheckProbe._check_torch, on attention_math.py) runs only
for a check whose error passes its tolerance or is NaN, to recompute it and explain it.

Same formulas as attention_math.rel_rows / attend: max |got - want| over everything / max |want|,
float32 attention with the causal mask, the model's scale and the GQA map (query head h reads KV
head h // (Hq / Hkv)). NaN propagates into the error, so a NaN never passes as clean.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from workbench.engine import kv_scale


def rows(t: torch.Tensor, idx: np.ndarray, idx_t: torch.Tensor) -> np.ndarray:
    """Rows idx of t as a float32 numpy copy: numpy's own indexing of a CPU float32 tensor, else
    torch's index_select and cast."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return (t.detach() if t.requires_grad else t).numpy()[idx]     # no detach (a dispatch) where none is needed
    return t.index_select(0, idx_t).float().cpu().numpy()


def view(t: torch.Tensor) -> np.ndarray:
    """t as float32 numpy: its own memory for a CPU float32 tensor (a view: valid while the tensor
    is), else a cast copy."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return (t.detach() if t.requires_grad else t).numpy()
    return t.float().cpu().numpy()


def view_rows(t: torch.Tensor, a: int, b: int) -> np.ndarray:
    """view(t[a:b]), the slice taken in numpy where t is CPU float32 (one torch call, not two)."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return view(t)[a:b]
    return view(t[a:b])


def stored(cache: torch.Tensor, pages: list, ctx: int) -> np.ndarray:
    """K or V of positions [0, ctx) as stored in those pages, [ctx, Hkv, D] float32 (shadow.stored_kv's
    result, read with numpy's indexing where the cache is plain CPU float32)."""
    if cache.device.type == "cpu" and cache.dtype == torch.float32 and kv_scale.page_scale(cache) is None:
        data = cache.numpy()[np.asarray(pages, dtype=np.int64)]
        return data.reshape(-1, *cache.shape[2:])[:ctx]
    from .shadow import stored_kv
    return stored_kv(cache, torch.tensor(pages, dtype=torch.long, device=cache.device), ctx).cpu().numpy()


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of h's rows with weight w (shadow._rms), in numpy where both are CPU float32, else shadow._rms."""
    if h.device.type == "cpu" and h.dtype == torch.float32 and w.dtype == torch.float32:
        x = h.detach().numpy()
        return torch.from_numpy(w.detach().numpy() * (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))))
    from .shadow import _rms
    return _rms(h, w, eps)


def rel(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (attention_math.rel_rows(...).max()); NaN stays NaN."""
    if got.size == 0:
        return 0.0
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)


@functools.lru_cache(maxsize=8)
def _inv_freq(d: int, theta: float) -> np.ndarray:
    # in float64, then the nearest float32: the frequencies as exactly as float32 holds them
    inv = (1.0 / (float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    return np.concatenate([inv, inv])


def rope_at(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x [r, H, D] rotated at positions pos [r] (rotate-half, as attention_check._rope_at)."""
    emb = (pos.astype(np.float32)[:, None] * _inv_freq(x.shape[-1], float(theta)))[:, None, :]
    h = x.shape[-1] // 2
    return x * np.cos(emb) + np.concatenate((-x[..., h:], x[..., :h]), axis=-1) * np.sin(emb)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, scale: float) -> np.ndarray:
    """q [r, Hq, D] over k, v [ctx, Hkv, D], key j read by the row at position p iff j <= p -> [r, Hq, D]."""
    r, hq, d = q.shape
    ctx, hkv = k.shape[:2]
    g = hq // hkv
    qg = q.reshape(r, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * r, d)
    # The two products in torch, on numpy's memory: numpy's matmul goes to OpenBLAS, whose threads
    # spin after a call and took a core from the engine's next layers (the check cost the run 3.3%
    # against 1.4% of its own time until OPENBLAS_NUM_THREADS=1); torch's run on the engine's own
    # pool. (numpy's plain loops, its path for strided K, took 17 ms for a prompt of 400 keys.)
    kt = torch.from_numpy(k).permute(1, 2, 0)                                  # [Hkv, D, ctx], strided
    s = torch.bmm(torch.from_numpy(qg), kt).numpy() * np.float32(scale)        # [Hkv, G*r, ctx]
    if int(pos.min()) < ctx - 1:                     # a row before the last key (not a decode row): mask
        masked = np.arange(ctx)[None, :] > pos[:, None]                         # [r, ctx]
        s[:, np.tile(masked, (g, 1))] = -np.inf
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = torch.bmm(torch.from_numpy(s), torch.from_numpy(v).transpose(0, 1)).numpy()     # [Hkv, G*r, Dv]
    return o.reshape(hkv, g, r, -1).transpose(2, 0, 1, 3).reshape(r, hq, -1)
