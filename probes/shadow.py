"""shadow: a sampled dense recompute of one sequence, against what the paged path produced.

The catch-all for numerics bugs nobody told us about (a wrong causal mask, a wrong page
read in a kernel, a RoPE position slip, a K/V write into the wrong slot). Now and then
the probe picks one sequence of the step and a layer L and recomputes layers 0..L for
that sequence from its own tokens: the model's weights (its Linear layers), torch for the
rest (RMSNorm, RoPE from fresh tables, SDPA in float32); no pages, no cache and none of the
batch's index tensors (positions are 0..ctx-1, slots come from seq.pages, its rows in
the step from the scheduler's decision). Per layer l <= L, in order, it compares
1. this step's K/V as stored in the sequence's slots with the K/V the model handed to
   the write (model hooks' on_kv): differ = a bad write;
2. the stored K/V of the whole context, and this step's q (on_q), with the dense
   recompute after RoPE: K and V wrong at token t = a bad write (the probe also looks
   for the slot they went to); only K (or q) wrong, matching a rotation at another
   position = a RoPE slip;
3. the paged attention output (on_attention_out) with float32 attention of the model's
   q over the stored K/V under the true causal mask: K/V right, output wrong = a bad
   read (block table, the kernel's page walk, the mask, cu_seqlens); it also tries the
   mask shifted by one;
4. the paged output with the fully dense attention: reported only where the model hands
   no q (otherwise 2 + 3 cover it; in bf16 a sharp softmax amplifies the dense
   recompute's rounding to ~0.4 of max here).
The first failing comparison of the first failing layer gives one error naming the
request, layer, first diverging token position and its page.

Tolerances: max |got - want| / max |want|. Measured clean maxima on the tests' sharp tiny
Llama and SmolLM2-135M (all layers), "same inputs" checks 1 and 3 / "from tokens"
check 2: fp32 4e-6 / 3e-5; fp16 model 6e-4 / 1e-2; bf16 model 4e-3 / 7e-2; fp16 or
fp16_scaled cache 5e-4 / 3e-3; bf16 cache 4e-3 / 3e-2. TOLERANCE sits 7-25x above those.

Cost: a check runs L+1 layers over the sequence's ctx tokens, ctx * (L+1) <= `budget`
token-layers (a longer sequence gets a shallower L, or waits for a shorter one), plus a
ctx x ctx attention per layer. SmolLM2-135M, fp32, 2 busy CPU cores, 16 streams: 30-45 ms,
0.3-0.6 of a decode step. every=None (the default) spaces checks by time so they take at
most `overhead` = 0.5% of the engine's wall time (after 2 warm-up forwards): one check
per ~70-120 decode steps there (it was 1% until the attention probe took over the
every-forward check of the attention math: the shadow is the time-spaced end-to-end
recompute). every=N checks every N forwards (tests: every=1). An unchecked forward costs
one Python call (forward_layers says: no layer).
"""
from __future__ import annotations

import time
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import instrumentation, kv_scale
from workbench.engine.model import rope_tables
from workbench.engine.taps import ModelTap
from workbench.probe import Probe

from .attention_math import rel_rows as _rel_rows
from .shadow_findings import HINT_OLD, HINT_READ, HINT_ROPE, HINT_WRITE, ShadowFindings, _rope  # noqa: F401

# (exact, drift) by the coarsest dtype involved (model or KV cache). "exact": the same inputs
# through two paths (checks 1 and 3), only the dtype's rounding separates them. "drift": the
# recompute from tokens (check 2), whose low-precision rounding grows through the layers.
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (5e-3, 1e-1), torch.bfloat16: (3e-2, 5e-1)}
ALLOW_FULL_PREFILL = 4          # every 4th check may take a whole-prompt prefill (no page read)
AUTO_WARMUP = 2                 # every=None: the first check after 2 forwards (short runs get one), then time-spaced


class _Tap(ModelTap):
    """What ModelHooks calls; each method already guarded by the probe (set on the instance: no
    extra call per layer). No hidden state: the model may skip unsampled rows' last layer."""

    needs = frozenset({"q", "kv", "attention_out"})

    def __init__(self, on_q, on_kv, on_out, forward_layers):
        self.on_q, self.on_kv, self.on_attention_out = on_q, on_kv, on_out
        self.forward_layers = forward_layers     # the layers up to the checked one, on a checked forward


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def scheduled_rows(engine, batch) -> tuple[list[int], list[int]]:
    """Each sequence's query rows this forward and where they start in the packed batch: the
    scheduler's decision (the step record), not cu_seqlens, which is what a packing bug corrupts;
    cu_seqlens only for a forward the scheduler did not plan."""
    seqs = batch.seqs
    rec = engine.step_record
    sched = rec.schedule.scheduled if rec is not None and rec.batch is batch and rec.schedule else []
    if len(sched) == len(seqs) and all(s is t for (s, _), t in zip(sched, seqs)):
        ns = [int(n) for _, n in sched]
    else:
        ns = np.diff(batch.cu_seqlens_q_np).astype(int).tolist()
    return ns, list(accumulate(ns, initial=0))             # a few Python adds, not three cold numpy calls


def checkable(seq, n: int, page_size: int, num_pages: int, budget: int | None = None) -> bool:
    """A sequence whose n rows this forward a dense check can read: rows to check, a context its
    tokens and page list cover, page ids inside the pool (a bad page list is page_table's to report)."""
    ctx = seq.num_computed_tokens + n
    need = -(-ctx // page_size)
    if n < 1 or (budget is not None and ctx > budget) or ctx > len(seq.token_ids) or len(seq.pages) < need:
        return False
    pages = seq.pages[:need]                # min / max: C loops (asked for every row of every step)
    return not pages or (min(pages) >= 0 and max(pages) < num_pages)


def stored_kv(cache: torch.Tensor, pages: torch.Tensor, ctx: int) -> torch.Tensor:
    """K or V of positions [0, ctx) as stored in those pages (a sequence's own page list), [ctx, Hkv, D] float32."""
    data = cache.index_select(0, pages)
    scale = kv_scale.page_scale(cache)
    if scale is not None:                           # fp16_scaled: undo each page's scale
        data = kv_scale.unscale(data, scale, pages, torch.float32)
    return data.reshape(-1, *cache.shape[2:])[:ctx].float()


def _attend(q, k, v, allowed, scale) -> torch.Tensor:
    """q [n, Hq, D] over k, v [ctx, Hkv, D] (float32), allowed [n, ctx] or None (causal) -> [n, Hq, D]."""
    t = lambda x: x.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=allowed, is_causal=allowed is None,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1)


class ShadowProbe(ShadowFindings, Probe):
    name = "shadow"
    description = "sampled dense recompute of one sequence's K/V and attention vs the paged path"

    def __init__(self, every: int | None = None, budget: int = 512, overhead: float = 0.005,
                 seed: int = 0, tolerance: float | dict | None = None, max_rows: int = 100_000,
                 on_demand: bool = False, **params):
        super().__init__(every=every, budget=budget, overhead=overhead, seed=seed, tolerance=tolerance,
                         max_rows=max_rows, on_demand=on_demand, **params)
        self.on_demand = bool(on_demand)        # only the checks check_now() asks for (divergence localisation)
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive int or None (auto), got {every!r}")
        if budget < 1 or not 0 < overhead < 1:
            raise ValueError(f"budget must be >= 1 and overhead in (0, 1), got {budget}, {overhead}")
        self.every, self.budget, self.overhead, self.max_rows = every, budget, overhead, max_rows
        self._tol_override = tolerance
        rng = np.random.default_rng(seed)
        self._cursor, self._layer_rr = int(rng.integers(1 << 16)), int(rng.integers(1 << 16))
        self.checks = 0
        self.forwards = 0
        self.last_check: list[dict] = []  # per layer of the last check: its errors (for a look by hand)
        self._last_forward = None        # forward index of the last check (fixed `every`)
        self._next_time = 0.0            # perf_counter when the next check is due (auto)
        self._force = None               # check_now(): (request_id, layer)
        self._plan = None
        self._q = None

    # ---- lifecycle ---------------------------------------------------------------
    def on_attach(self, engine) -> None:
        self._tap = _Tap(self.guard(self._on_q), self.guard(self._on_kv), self.guard(self._on_out),
                         self.guard(self._forward_layers))
        instrumentation.add_tap(engine, self._tap)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._plan = self._q = None

    def reset(self) -> None:
        super().reset()
        self.checks = 0

    def check_now(self, request_id=None, layer: int | None = None) -> None:
        """Check the next forward, whatever `every` says (that request and layer, when given and
        it fits the budget)."""
        self._force = (request_id, layer)

    def tolerance(self) -> tuple[float, float]:
        """(exact, drift) for this engine's model and KV cache dtypes."""
        o = self._tol_override
        if isinstance(o, (int, float)):
            return float(o), float(o)
        tol = dict(TOLERANCE)
        for k, v in (o or {}).items():
            tol[getattr(torch, k) if isinstance(k, str) else k] = (v, v) if isinstance(v, (int, float)) else tuple(v)
        m, c = (tol.get(d, TOLERANCE[torch.bfloat16]) for d in (self.engine.model.dtype, self.engine.kv.k[0].dtype))
        return max(m[0], c[0]), max(m[1], c[1])

    # ---- taps (inside model.forward) ----------------------------------------------------
    def _due(self) -> bool:
        if self._force is not None:
            return True
        if self.on_demand:
            return False
        if self.every is None:
            return self.forwards > AUTO_WARMUP and time.perf_counter() >= self._next_time
        return self._last_forward is None or self.forwards - self._last_forward >= self.every

    def _forward_layers(self, batch):
        """Once per forward: whether a check is due and of what; the hooks call the taps at the
        layers up to the checked one on that forward, at none on the others."""
        self._q = None
        self.forwards += 1
        p = self._plan = self._pick(batch) if self._due() else None
        if p is not None:
            p["cost_ns"] = self.cost_ns      # what the probe had spent: the check's taps count towards its budget
        return range(p["layer"] + 1) if p is not None else ()

    def _on_q(self, layer, q) -> None:
        self._q = (layer, q)             # comes right before on_kv of the same layer

    def _on_kv(self, layer, k, v, batch) -> None:
        q, self._q = self._q, None
        p = self._plan
        if p is None or layer > p["layer"]:
            return
        a, b = p["row"], p["row"] + p["n"]
        # What the model computed for the sequence's rows: the values handed to the K/V write.
        p["k"].append(k[a:b].float().clone())
        p["v"].append(v[a:b].float().clone())
        p["q"].append(q[1][a:b].float().clone() if q is not None and q[0] == layer else None)

    def _on_out(self, layer, o, batch) -> None:
        p = self._plan
        if p is None or layer > p["layer"]:
            return
        p["o"].append(o[p["row"]:p["row"] + p["n"]].float().clone())     # what the paged path produced
        if layer == p["layer"]:
            self._plan = None
            self._check(p)

    # ---- which sequence, which layer -----------------------------------------------------
    def _pick(self, batch):
        seqs = batch.seqs
        ns, rows = scheduled_rows(self.engine, batch)
        ps, npages = batch.page_size, self.engine.kv.k[0].shape[0]
        want_rid, want_layer = self._force or (None, None)
        fits, reads = [], []
        for j in range(len(seqs)):
            i = (self._cursor + j) % len(seqs)
            s, n = seqs[i], ns[i]
            ctx = s.num_computed_tokens + n
            if not checkable(s, n, ps, npages, self.budget):
                continue
            if want_rid is not None and s.request_id == want_rid:
                fits, reads = [i], [i]
                break
            fits.append(i)
            if ctx > n:
                reads.append(i)
        if not fits:
            return None                                     # stays due: the next forward tries again
        # Rows that read pages first; whole-prompt prefills (no page read) now and then.
        pool = fits if not reads or self.checks % ALLOW_FULL_PREFILL == ALLOW_FULL_PREFILL - 1 else reads
        i = pool[0]
        s, n = seqs[i], ns[i]
        ctx = s.num_computed_tokens + n
        nl = self.engine.model_config.num_layers
        lmax = min(nl - 1, self.budget // ctx - 1)
        if getattr(self.engine, "parallel", None) is not None:
            lmax = 0        # tensor parallel: layer 0 over rank 0's heads (deeper layers need the all-reduced state)
        layer = want_layer if want_layer is not None else self._layer_rr % nl
        self._force = None
        self._cursor += 1
        self._layer_rr += 1
        return {"seq": s, "row": int(rows[i]), "n": n, "ctx": ctx, "start": s.num_computed_tokens,
                "layer": max(0, min(int(layer), lmax)), "step": self.engine.step_count,
                "q": [], "k": [], "v": [], "o": []}

    # ---- the check ---------------------------------------------------------------------------
    @torch.no_grad()
    def _check(self, p) -> None:
        t0 = time.perf_counter()
        eng = self.engine
        m, cfg, kv = eng.model, eng.model.cfg, eng.kv
        seq, ctx, start, L = p["seq"], p["ctx"], p["start"], p["layer"]
        hq, hkv, hd, ps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv.page_size
        exact, drift = self.tolerance()
        scale = hd ** -0.5                              # the model's, not the backend's
        ids = torch.tensor(seq.token_ids[:ctx], dtype=torch.long, device=m.device)
        pages = torch.tensor(seq.pages[: -(-ctx // ps)], dtype=torch.long, device=m.device)
        cos, sin = (t.to(m.device)[:, None, :] for t in rope_tables(hd, ctx, cfg.rope_theta))
        causal = torch.arange(ctx, device=m.device)[None, :] <= torch.arange(start, ctx, device=m.device)[:, None]
        h = F.embedding(ids, m.embed).to(m.dtype)     # the table may be stored narrower (bf16 storage)
        self.last_check, found = [], None
        for l in range(L + 1):
            Ly = m.layers[l]
            qkv = Ly.qkv(_rms(h, Ly.norm_attn, cfg.rms_norm_eps)).float()
            q_raw = qkv[:, : m.q_size].view(ctx, hq, hd)
            k_raw = qkv[:, m.q_size: m.q_size + m.kv_size].view(ctx, hkv, hd)
            q, k = _rope(q_raw, cos, sin), _rope(k_raw, cos, sin)
            v = qkv[:, m.q_size + m.kv_size:].view(ctx, hkv, hd)
            o = _attend(q, k, v, None, scale)                     # dense: no pages, no cache
            if not bool(torch.isfinite(o).all()):
                break                                   # the model itself overflows: fp16_overflow's finding
            ks, vs = self._stored(kv.k[l], pages, ctx), self._stored(kv.v[l], pages, ctx)
            qe, o_paged = p["q"][l], p["o"][l]
            # What the paged path should have attended over: the pages, or, for a prompt computed
            # whole in this step (nothing to read), the K/V it just computed.
            kr, vr = (ks, vs) if start else (p["k"][l], p["v"][l])
            e = {"layer": l,
                 # this step's K/V as stored vs as handed to the write (same values, two paths)
                 "write_k": _rel_rows(ks[start:], p["k"][l]), "write_v": _rel_rows(vs[start:], p["v"][l]),
                 # stored K/V of the whole context and this step's q vs the dense recompute
                 "kv_k": _rel_rows(ks, k), "kv_v": _rel_rows(vs, v),
                 "q": _rel_rows(qe, q[start:]) if qe is not None else None,
                 # paged output vs attention of the engine's q over the stored K/V (the read alone)
                 "read": _rel_rows(o_paged, _attend(qe, kr, vr, causal, scale)) if qe is not None else None,
                 # paged output vs the dense recompute
                 "dense": _rel_rows(o_paged, o[start:])}
            self.last_check.append({k_: (float(x.max()) if isinstance(x, torch.Tensor) else x)
                                    for k_, x in e.items()})
            found = self._judge(p, e, exact, drift, (q_raw, k_raw, ks, qe, kr, vr, k, v, scale))
            if found is not None:
                break
            if l < L:                                   # on to the next layer, as model.forward does
                h = Ly.o.add(o.to(m.dtype).reshape(ctx, hq * hd), h)
                x = _rms(h, Ly.norm_mlp, cfg.rms_norm_eps)
                h = Ly.down.add(Ly.up.mul(x, Ly.gate.silu(x)), h)
        dt = time.perf_counter() - t0
        self.checks += 1
        self._last_forward = self.forwards
        # spaced by all the check cost: the recompute and the taps on its forward's layers (the guard adds
        # this call's time to cost_ns after it returns)
        spent = dt + max(0, self.cost_ns - p.get("cost_ns", self.cost_ns)) / 1e9
        self._next_time = time.perf_counter() + spent / self.overhead
        worst = lambda *names: max((c[n] for c in self.last_check for n in names if c[n] is not None), default=0.0)
        self.rows.append({"step": p["step"], "request_id": seq.request_id, "layer": L, "ctx": ctx, "rows": p["n"],
                          "max_err_out": worst("read"), "max_err_write": worst("write_k", "write_v"),
                          "tolerance": exact, "max_err_kv": worst("kv_k", "kv_v"), "max_err_q": worst("q"),
                          "max_err_dense": worst("dense"), "tolerance_drift": drift, "bad_layer": found,
                          "us": dt * 1e6})
        if len(self.rows) > self.max_rows:              # a probe must not become the leak it hunts
            del self.rows[: len(self.rows) // 2]

    def _stored(self, cache: torch.Tensor, pages: torch.Tensor, ctx: int) -> torch.Tensor:
        return stored_kv(cache, pages, ctx)

    # ---- findings ----------------------------------------------------------------------------
    def _judge(self, p, e, exact, drift, t):
        """Report the first thing wrong in layer e['layer'], most specific first; returns the layer or None."""
        q_raw, k_raw, ks, qe, kr, vr, k, v, scale = t
        l, start = e["layer"], p["start"]
        bad = lambda x, tol: x is not None and bool((x > tol).any())
        if bad(e["write_k"], exact) or bad(e["write_v"], exact):
            r = int(torch.nonzero((e["write_k"] > exact) | (e["write_v"] > exact))[0])
            self._report_write(p, l, start + r, e["write_k"][r], e["write_v"][r], exact, k, v,
                               "the K/V the model computed for it this step were not stored at its slot")
        elif bad(e["kv_k"], drift) or bad(e["kv_v"], drift):
            pos = (e["kv_k"] > drift) | (e["kv_v"] > drift)
            r = int(torch.nonzero(pos)[0])
            at = None if bad(e["kv_v"], drift) else self._rotated_at(k_raw[r], ks[r], r, drift)
            if at is not None:
                self._report_rope(p, l, r, at, "K", e["kv_k"][r], drift)
            else:
                self._report_write(p, l, r, e["kv_k"][r], e["kv_v"][r], drift, k, v,
                                   "the K/V stored for it differ from a dense recompute from its tokens",
                                   wrong=int(pos.sum()), maybe_read=l > 0 and r < start)
        elif bad(e["q"], drift):
            r = int(torch.nonzero(e["q"] > drift)[0])
            at = self._rotated_at(q_raw[start + r], qe[r], start + r, drift)
            if at is not None:
                self._report_rope(p, l, start + r, at, "q", e["q"][r], drift)
            else:
                self._report_read(p, l, e["q"], drift, "the query the model computed differs from a dense "
                                                       "recompute from its tokens")
        elif bad(e["read"], exact):
            self._report_read(p, l, e["read"], exact, "paged attention output differs from attention over the "
                                                      "K/V in its pages, which are right: a bad read",
                              self._mask_diagnosis(p, p["o"][l], qe, kr, vr, exact, scale))
        elif e["q"] is None and bad(e["dense"], drift):     # no q from the model: only the dense check
            self._report_read(p, l, e["dense"], drift, "paged attention output differs from a dense recompute "
                                                       "from its tokens")
        else:
            return None
        return l

    def widget(self):
        """Error per check (relative to max |x|) against its tolerance."""
        import plotly.express as px
        df = self.frame()
        if df.empty:
            return px.scatter(title=f"{self.name}: no checks yet")
        return px.scatter(df, x="step", y=["max_err_out", "max_err_write", "tolerance", "max_err_kv",
                                           "tolerance_drift"], log_y=True,
                          hover_data=["request_id", "layer", "ctx"], title="shadow check: dense vs paged")
