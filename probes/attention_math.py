"""Float32 attention over a request's stored K/V, and the nearest explanations of a kernel that
disagrees with it: one implementation for the attention check in our engine (attention_check.py)
and the one inside vLLM's workers (workbench/adapters/vllm/attention_watch.py).

Plain torch, no engine and no vLLM imports. Shapes: q [rows, Hq, D]; k, v [ctx, Hkv, D] (the
context's keys from position `base` on); `allowed` [rows, ctx] says which keys a row may read.
"""
from __future__ import annotations

import math

import numpy as np
import torch

MAX_PAGE_TRIES = 64             # page explanations are tried for contexts of at most this many pages


def rel_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """max |got - want| per row (token), relative to max |want| over all rows; NaN counts as wrong."""
    err = (got.float() - want).abs().amax(dim=tuple(range(1, want.dim()))) / want.abs().amax().clamp_min(1e-30)
    return torch.nan_to_num(err, nan=math.inf)


def head_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per head, max |got - want| relative to max |want|: [H]."""
    return torch.nan_to_num((got.float() - want).abs().amax(dim=(0, 2)) / want.abs().amax().clamp_min(1e-30),
                            nan=math.inf)


def causal(pos: torch.Tensor, ctx: int, base: int = 0, window: int = 0, shift: int = 0,
           chunk: int = 0) -> torch.Tensor:
    """[rows, ctx]: key base + j is read by the row at position p iff base + j <= p + shift and, with a
    sliding window of W tokens, base + j > p - W (vLLM's and FlashAttention's (W - 1, 0)); with
    chunked-local attention of C tokens (Llama 4), only keys of p's own chunk: (base + j) // C == p // C."""
    keys = base + torch.arange(ctx, device=pos.device)[None, :]
    ok = keys <= pos[:, None] + shift
    if window > 0:
        ok &= keys > pos[:, None] - window
    if chunk > 0:
        ok &= keys // chunk == pos[:, None] // chunk
    return ok


def _scores(q, k, scale, kv_head, softcap):
    s = torch.bmm(q.transpose(0, 1), k.index_select(1, kv_head).permute(1, 2, 0)) * scale     # [Hq, r, ctx]
    return softcap * torch.tanh(s / softcap) if softcap else s


def weights(q, k, allowed, scale, kv_head, softcap: float = 0.0) -> torch.Tensor:
    """The attention weights of q [r, Hq, D] over k [ctx, Hkv, D], query head h reading KV head
    kv_head[h], under allowed [r, ctx] -> [Hq, r, ctx]."""
    return torch.softmax(_scores(q, k, scale, kv_head, softcap).masked_fill(~allowed[None], -math.inf), dim=-1)


def gqa_map(hq: int, hkv: int, device=None) -> torch.Tensor:
    """Query head h reads KV head h // (Hq / Hkv)."""
    return torch.arange(hq, device=device) // (hq // hkv)


def attend(q, k, v, allowed, scale, kv_head=None, softcap: float = 0.0) -> torch.Tensor:
    """q [r, Hq, D] over k, v [ctx, Hkv, D] (float32) -> [r, Hq, Dv]; kv_head [Hq]: the KV head each
    query head reads (default: the GQA map, as batched matmuls per KV head)."""
    r, hq, d = q.shape
    hkv = k.shape[1]
    if kv_head is None and not softcap:             # the G query heads of a KV head ride on the row axis
        g = hq // hkv
        qg = q.reshape(r, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * r, d)
        s = torch.bmm(qg, k.permute(1, 2, 0)) * scale                         # [Hkv, G*r, ctx]
        s = s.masked_fill(~allowed.repeat(g, 1)[None], -math.inf)
        o = torch.bmm(torch.softmax(s, dim=-1), v.transpose(0, 1))           # [Hkv, G*r, Dv]
        return o.reshape(hkv, g, r, -1).permute(2, 0, 1, 3).reshape(r, hq, -1)
    if kv_head is None:
        kv_head = gqa_map(hq, hkv, q.device)
    return torch.bmm(weights(q, k, allowed, scale, kv_head, softcap), v.index_select(1, kv_head).transpose(0, 1)) \
        .transpose(0, 1)


def mask_shift(q, got, k, v, pos, scale: float, tol: float, *, base: int = 0, window: int = 0,
               softcap: float = 0.0, chunk: int = 0):
    """The causal mask shifted by one either way, where it reproduces got: (words, allowed) or None."""
    for d, what in ((1, "each query also sees the next key"), (-1, "each query misses its own key")):
        shifted = causal(pos, k.shape[0], base, window, shift=d, chunk=chunk)
        shifted[:, 0] |= ~shifted.any(-1)               # a row with no key at all would be NaN
        if float(rel_rows(got, attend(q, k, v, shifted, scale, softcap=softcap)).max()) <= tol:
            return f"causal mask shifted by {d:+d} ({what})", shifted
    return None


def explain_read(q, got, k, v, pos, scale: float, tol: float, *, heads, base: int = 0, window: int = 0,
                 softcap: float = 0.0, page_size: int = 0, pages=None, start: int = 0, chunk: int = 0):
    """The nearest explanation of a bad read whose output it reproduces: (kind, words, the inputs to
    attention that reproduce it: any of allowed / scale / kv_head / k / v) or None.

    Tries, in order: the causal mask shifted by one either way; a few wrong scales; another KV head
    for each wrong query head; one page of the context left out; one page read from its neighbour's
    slot (a page walk that repeats or skips a page). Page tries need page_size, the pages' ids and a
    context that reads pages (start > 0, at most MAX_PAGE_TRIES pages)."""
    ctx = k.shape[0]
    hq, hkv, hd = q.shape[1], k.shape[1], q.shape[2]
    allowed = causal(pos, ctx, base, window, chunk=chunk)

    def same(allowed_=allowed, scale_=scale, kv_head=None, k_=k, v_=v):
        return float(rel_rows(got, attend(q, k_, v_, allowed_, scale_, kv_head, softcap)).max()) <= tol

    shifted = mask_shift(q, got, k, v, pos, scale, tol, base=base, window=window, softcap=softcap, chunk=chunk)
    if shifted is not None:
        return "mask", f"a {shifted[0]}", {"allowed": shifted[1]}
    model = hd ** -0.5
    for s_, what in ((1.0 / hd, "1/head_dim"), (1.0, "1"), (hd ** -0.25, "head_dim^-1/4"),
                     (2 * scale, "twice the model's"), (scale / 2, "half the model's")):
        if abs(s_ - scale) > 1e-6 * scale and same(scale_=s_):
            said = f"; the model's is {scale:.4g}" + (" = head_dim^-1/2" if abs(scale - model) < 1e-6 else "")
            return "scale", f"the scale {what} ({s_:.4g}{said})", {"scale": s_}
    if heads and hkv > 1:                           # which KV head does each wrong query head read?
        default = gqa_map(hq, hkv, q.device)
        read = {}
        for h in heads:
            for j in range(hkv):
                kvh = default.clone()
                kvh[h] = j
                o = attend(q, k, v, allowed, scale, kvh, softcap)
                if float(head_err(got[:, h:h + 1], o[:, h:h + 1]).max()) <= tol:
                    read[h] = j
                    break
        if read and len(read) == len(heads) and any(j != int(default[h]) for h, j in read.items()):
            kvh = default.clone()
            for h, j in read.items():
                kvh[h] = j
            return "kv-head-map", ("another GQA map: query head -> KV head read " +
                                   ", ".join(f"{h}->{j} (want {int(default[h])})" for h, j in read.items())), \
                {"kv_head": kvh}
    if not page_size or not start or pages is None:
        return None
    npg = -(-ctx // page_size)
    if not 1 < npg <= MAX_PAGE_TRIES:
        return None
    keys = torch.arange(ctx, device=k.device)[None, :]
    name = lambda i: f"page index {i + base // page_size} (page {int(pages[i])})"  # noqa: E731
    for i in range(npg):
        skip = allowed & ~((keys >= i * page_size) & (keys < (i + 1) * page_size))
        if bool(skip.any(-1).all()) and same(skip):
            return "page-skipped", f"attention with {name(i)} left out", {"allowed": skip}
    for i in range(npg):
        lo, hi = i * page_size, min(ctx, (i + 1) * page_size)
        for j in (i - 1, i + 1):
            if not 0 <= j < npg or min(ctx, (j + 1) * page_size) - j * page_size < hi - lo:
                continue
            k2, v2 = k.clone(), v.clone()
            k2[lo:hi], v2[lo:hi] = k[j * page_size: j * page_size + hi - lo], v[j * page_size: j * page_size + hi - lo]
            if same(k_=k2, v_=v2):
                return "page-substituted", (f"attention that read {name(i)} from the slots of {name(j)}: a page "
                                            f"walk that repeated or skipped a page"), {"k": k2, "v": v2}
    return None


PICTURE_KEYS = 512          # a picture keeps the last this many keys before the query (a finding stays small)


def picture(q, k, r: int, pos: int, scale: float, *, base: int = 0, window: int = 0, softcap: float = 0.0,
            explained: dict | None = None, heads=None, page_size: int = 0, max_keys: int = PICTURE_KEYS,
            chunk: int = 0) -> dict:
    """Row r's attention weights per query head over its context, for a finding's picture: `want`, what
    the model means (float32 over the request's own stored K, the true causal mask and window, the
    model's scale and GQA map) and, when an explanation reproduced the backend's output (explain_read's
    third item: allowed / scale / kv_head / k), `got`, what the backend attended with. Only `heads`
    (default all), and only the last max_keys keys up to the query: plain lists, ready for JSON."""
    hq, hkv, ctx = q.shape[1], k.shape[1], k.shape[0]
    gqa = gqa_map(hq, hkv, q.device)
    allowed = causal(torch.tensor([pos], device=q.device), ctx, base, window, chunk=chunk)

    def w(allowed_, scale_, kv_head, k_):
        return weights(q[r:r + 1], k_, allowed_, scale_, kv_head, softcap)[:, 0]        # [Hq, ctx]
    want = w(allowed, scale, gqa, k)
    got = None
    if explained is not None:
        e = explained
        got = w(e["allowed"][r:r + 1] if "allowed" in e else allowed, e.get("scale", scale), e.get("kv_head", gqa),
                e.get("k", k))
    heads = list(range(hq)) if not heads else [int(h) for h in heads]
    hi = min(ctx, pos - base + 1)
    lo = max(0, hi - max_keys)

    def rows(t):
        return None if t is None else [[round(x, 7) for x in t[h, lo:hi].tolist()] for h in heads]
    return {"position": int(pos), "first_key": int(base + lo), "page_size": int(page_size), "heads": heads,
            "want": rows(want), "got": rows(got)}


def sample_rows(n: int, f: int, max_rows: int) -> np.ndarray:
    """The query rows of an n-row chunk to check: all when few, else the first, the last and
    max_rows - 2 between them, shifted by f so that every row is met within n / max_rows checks."""
    if n <= max_rows:
        return np.arange(n)
    k = max_rows - 2
    step = -(-(n - 2) // k)
    inner = 1 + (np.arange(k) * step + f % step) % (n - 2)
    return np.unique(np.concatenate([[0], inner, [n - 1]]))
