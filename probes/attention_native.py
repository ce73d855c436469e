"""The attention check's clean path compiled (csrc/attention_check.c), numpy's (attention_numpy.py) its
reference and its fallback.

The check runs on every forward, right after a layer's attention, when the CPU's caches hold the
forward's weights: numpy's small ops pay a cold dispatch there, and a decode row's clean check was
~25 of them (~600 us on the Intel host, ~330 us when the same check ran again warm). The C twin does
the write and read errors in one call that reads the request's K/V straight from its pages, and the
RoPE check's norm and rotation in two more; the layer's qkv projection of the checked rows stays
the model's own linear. What it computes is attention_numpy's, formula for formula (tested against
it, and tried against it once per process before the probe uses it).

Where it runs: the model and a plain float32 KV cache on the CPU (the probe's common case). Anything
else (bf16 / fp16 / scaled caches, another device) keeps the numpy path, as does a process where the
module is not available: no C compiler, PAGEDKV_PROBE_KERNELS=numpy, PAGEDKV_CPU_FEATURES=none, or a
failed trial. Portable C (no -march): it loads on any CPU the interpreter runs on.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workbench.engine import kv_scale
from workbench.engine.kernels import Kernel, Spec

from . import attention_numpy as fast

SOURCE = Path(__file__).with_name("csrc") / "attention_check.c"
CHECK = Kernel(Spec("pagedkv_attention_check", (SOURCE,), "compiled attention check", kind="c", flags=("-O3",),
                    ldflags=("-lm",), headers=(), switch=("PAGEDKV_PROBE_KERNELS", "numpy")),
               fallback="the numpy check (probes/attention_numpy.py)", trial="probes.attention_native:trial")


def module(cache: torch.Tensor, model_dtype: torch.dtype):
    """The compiled module where it applies to this cache and model (CPU, plain float32), else None."""
    if (cache.device.type != "cpu" or cache.dtype != torch.float32 or model_dtype != torch.float32
            or kv_scale.page_scale(cache) is not None):
        return None
    return CHECK.get()


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def check(mod, k_cache, v_cache, pages, ctx: int, start: int, k_new, v_new, q, o, pos, scale: float):
    """(write error, read error or None) of attention_numpy's clean check, in one call. The caches as numpy
    arrays (CacheViews: made once per layer, a tensor's .numpy() cost ~30 us cold between a forward's
    kernels) or tensors; pages a list (read in C) or an array."""
    if isinstance(k_cache, torch.Tensor):
        k_cache, v_cache = k_cache.numpy(), v_cache.numpy()
    if not isinstance(pages, list):
        pages = np.asarray(pages, dtype=np.int64)
    return mod.check(k_cache, v_cache, pages, ctx, start, _f32(k_new),
                     _f32(v_new), None if q is None else _f32(q), None if q is None else _f32(o),
                     np.asarray(pos, dtype=np.int64), float(scale))


class CacheViews:
    """Each layer's K and V cache as numpy arrays over the tensors' memory, made on first use and kept
    while the engine holds the same tensors (a re-paged cache is new tensors: its views are made anew)."""

    def __init__(self):
        self._views: dict[int, tuple] = {}

    def get(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int) -> tuple:
        got = self._views.get(layer)
        if got is None or got[0] is not k_cache or got[1] is not v_cache:
            if got is not None:          # a re-paged cache: every layer's old tensors let go now, not when checked
                self._views.clear()
            got = self._views[layer] = (k_cache, v_cache, k_cache.numpy(), v_cache.numpy())
        return got[2], got[3]

    def clear(self) -> None:
        self._views.clear()


def rms_norm(mod, h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of h's rows (CPU float32) with weight w, into a new tensor."""
    out = np.empty(tuple(h.shape), dtype=np.float32)
    mod.rms_norm(_f32(h.detach().numpy()), _f32(w.detach().numpy()), float(eps), out)
    return torch.from_numpy(out)


def rope(mod, qkv: np.ndarray, q_size: int, kv_size: int, head_dim: int, theta: float, q, k, pos) -> float:
    """max of the q and k rotation errors (attention_numpy.rel of each against rope_at of qkv's parts)."""
    return mod.rope(_f32(qkv), q_size, kv_size, head_dim, float(theta), None if q is None else _f32(q), _f32(k),
                    np.asarray(pos, dtype=np.int64))


# ---- the trial: the module against attention_numpy on a small case, once per process ---------------
def _near(got: float, want: float, what: str) -> None:
    if not abs(got - want) <= 1e-5 + 1e-3 * abs(want):
        raise AssertionError(f"{what}: {got!r}, the numpy check gives {want!r}")


def trial(mod) -> None:
    """Raises where the module's errors are not attention_numpy's: a clean case (both ~0), one with a
    slot written wrong, one with a wrong output row and one with NaN, for a decode row, a prefill
    chunk after cached context and a whole prompt; then the norm and the rotation."""
    rng = np.random.default_rng(7)
    P, ps, hkv, g, D = 9, 4, 2, 3, 8
    kc = torch.from_numpy(rng.standard_normal((P, ps, hkv, D), dtype=np.float32))
    vc = torch.from_numpy(rng.standard_normal((P, ps, hkv, D), dtype=np.float32))
    pages = [5, 2, 7, 0]
    scale = D ** -0.5
    for ctx, start, r in ((13, 12, 1), (14, 6, 3), (11, 0, 4)):
        ks, vs = fast.stored(kc, pages, ctx), fast.stored(vc, pages, ctx)
        kn, vn = ks[start:].copy(), vs[start:].copy()
        pos = np.sort(rng.choice(np.arange(start, ctx), r, replace=False)).astype(np.int64)
        q = rng.standard_normal((r, hkv * g, D), dtype=np.float32)
        kr, vr = (ks, vs) if start else (kn, vn)
        o = np.ascontiguousarray(fast.attend(q, kr, vr, pos, scale), dtype=np.float32)
        bad_kn = kn.copy()
        bad_kn[-1, 1, 3] += 0.5
        bad_o = o.copy()
        bad_o[-1, 4, 2] += 0.25
        for what, k_new, out in (("clean", kn, o), ("a slot written wrong", bad_kn, o), ("a wrong output", kn, bad_o),
                                 ("NaN", kn, np.where(np.arange(o.size).reshape(o.shape) == 5, np.nan, o))):
            want_w = max(fast.rel(ks[start:], k_new), fast.rel(vs[start:], vn))
            want_r = fast.rel(out, fast.attend(q, kr if start else k_new, vr, pos, scale))
            got_w, got_r = check(mod, kc, vc, pages, ctx, start, k_new, vn, q, out, pos, scale)
            if np.isnan(want_r) != np.isnan(got_r):
                raise AssertionError(f"{what} (ctx {ctx}, start {start}): read error {got_r}, numpy's {want_r}")
            _near(got_w, want_w, f"{what} (ctx {ctx}, start {start}): the write error")
            if not np.isnan(want_r):
                _near(got_r, want_r, f"{what} (ctx {ctx}, start {start}): the read error")
    h = torch.from_numpy(rng.standard_normal((3, 12), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal(12, dtype=np.float32))
    want = fast.rms_norm(h, w, 1e-5).numpy()
    got = rms_norm(mod, h, w, 1e-5).numpy()
    if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"rms_norm: {got.ravel()[:4]}, numpy's {want.ravel()[:4]}")
    qkv = rng.standard_normal((3, 4 * D + 2 * D + 2 * D), dtype=np.float32)
    pos = np.array([0, 5, 1000], dtype=np.int64)
    q_raw, k_raw = qkv[:, :4 * D].reshape(3, 4, D), qkv[:, 4 * D:6 * D].reshape(3, 2, D)
    q_rot, k_rot = fast.rope_at(q_raw, pos, 10000.0), fast.rope_at(k_raw, pos, 10000.0)
    _near(rope(mod, qkv, 4 * D, 2 * D, D, 10000.0, q_rot, k_rot, pos), 0.0, "rope, rotated right")
    slipped = fast.rope_at(k_raw, pos + 1, 10000.0)
    _near(rope(mod, qkv, 4 * D, 2 * D, D, 10000.0, q_rot, slipped, pos), fast.rel(slipped, k_rot),
          "rope, k rotated one position on")
