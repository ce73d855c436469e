"""attention: every forward, one request row and one layer checked against float32 attention
over that request's own stored K/V, from the model's own inputs to attention.

The shadow recomputes a sequence from its tokens through every layer, so it can only afford a
check every few dozen steps, and a persistent math bug is caught only where its sample lands.
This check takes what the layer handed to attention (q, the K/V it wrote, its input hidden state)
and what attention handed back, for one layer and a few query rows of one request, so it costs
a gather of that request's pages for one layer and a few rows of attention: it runs on every
forward. Per check, in this order:

1. write: this step's K/V as stored in the request's slots (read through its own page list,
   ``seq.pages``, never the batch's block table or slot mapping) vs the K/V the layer handed
   to the write: a bad write, a slot slip, heads stored in another order;
2. rope: the sampled rows' q and k vs the layer's own projection of its input hidden state,
   rotated at the row's true position (``num_computed_tokens`` + offset in the chunk): a RoPE
   position slip (which the write and read checks cannot see: a q and k rotated at the wrong
   position are stored and read consistently);
3. read: the paged attention output of the sampled rows vs float32 attention of the layer's q
   over the stored K/V, with the true causal mask (a key at position <= the query's), the
   model's scale (head_dim ** -0.5) and its GQA map (query head h reads KV head h // group);
   our engine's models have no sliding window or soft-cap. When it fails, the check tries the
   nearest explanations: the mask shifted by one, another scale, another KV head for the wrong
   query heads, one page of the context left out, the pages the batch's block table names in
   place of the request's own. `figure(finding)` draws the row's attention weights per head,
   the model's against the ones that reproduce the kernel's output.

Rotation: forward f checks layer f % L and a row of kind KINDS[(f + f // L) % 3] (decode, a
prefill chunk that reads pages, a whole prompt), falling back to the next kind the batch has;
within a kind, alternately the row with the longest context and the next in turn. So every
layer is checked every L forwards, every kind within 3 forwards of its being in the batch, and
every (layer, kind) pair within 3L. Prefill rows: up to `max_rows` query rows (the first, the
last, evenly between, the ones between shifting from check to check); the write check covers all
of the request's rows this step.

Cost: the check runs right after the layer's attention, when the caches hold the forward's weights,
not the check's few kilobytes, and each small torch op pays a cold dispatch (~10 us there, ~2 us
warm). So a clean check is computed in three calls of compiled C (attention_native.py: the write and
read errors reading the request's pages in place, the norm and the rotation of the rope check; the
qkv projection is the layer's own linear), numpy's (attention_numpy.py, the same formulas) where
that does not apply (a cache that is not plain float32 on the CPU, no compiler,
PAGEDKV_PROBE_KERNELS=numpy). On SmolLM2's decode rows: ~0.3 ms compiled, ~0.6 ms in numpy, ~1 ms in
torch. The torch code below runs only when an error passes its tolerance (or is NaN): it recomputes
that check and writes the finding with its explanations.

Tolerances (max |got - want| / max |want|) are the shadow's "same inputs" ones by the coarsest
dtype (fp32 1e-4, fp16 5e-3, bf16 3e-2), 10x that for the rope check (ROPE_MARGIN). The first
failing comparison gives one error per (kind, request, layer), naming the request, layer, heads,
query position and page.
"""
from __future__ import annotations

import functools

import time

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import instrumentation
from workbench.engine.taps import ModelTap
from workbench.probe import Probe

from . import attention_native as native
from . import attention_numpy as fast
from .attention_math import attend as _attend
from .attention_math import causal, explain_read, sample_rows
from .attention_math import picture as _picture_of
from .attention_picture import attention_figure
from .attention_math import rel_rows as _rel_rows
from .attention_math import head_err as _head_err
from .shadow import TOLERANCE, _rms, _rope, checkable, scheduled_rows, stored_kv

KINDS = ("decode", "chunk", "prefill")
# The rope check recomputes the layer's projection for a few rows, through another GEMM path than
# the batch's (the skinny kernel, not oneDNN): its rounding differs by up to ~1.2e-4 of max in fp32
# on the tests' sharp Llama. A position slip moves q / k by O(1) of max, far above 10x.
ROPE_MARGIN = 10
MAX_PICTURES = 32               # attention-weight pictures kept (one per finding key, the first ones)

HINT_WRITE = ("the K/V stored at the request's slots are not the ones the layer handed to the write: check "
              "slot_mapping, the head layout of the store (write_kv / rope_write) and the page list")
HINT_ROPE = ("q / k were rotated at another position than the row's (num_computed_tokens + offset): check "
             "batch.positions and the cos / sin rows RoPE reads")
HINT_READ = ("the pages hold the right K/V but attention over them is wrong: check the kernel's causal mask "
             "(bottom-right aligned over the context), its scale, its query-head to KV-head map, the pages it "
             "walks (context length, page index) and the block table rows it reads")


class _Tap(ModelTap):
    needs = frozenset({"q", "kv", "attention_out", "hidden"})

    def __init__(self, on_q, on_kv, on_out, on_hidden, forward_layers):
        self.on_q, self.on_kv, self.on_attention_out, self.on_hidden = on_q, on_kv, on_out, on_hidden
        self.forward_layers = forward_layers     # the checked layer and the one before (its input)


@functools.lru_cache(maxsize=8)
def _inv_freq(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies, recomputed here from (d, theta), not read from the model, once."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    return torch.cat([inv, inv])[None]


def _rope_tables(pos: torch.Tensor, d: int, theta: float):
    """cos, sin [r, 1, d] at positions pos [r]."""
    emb = (pos.float()[:, None] * _inv_freq(d, float(theta), pos.device))[:, None, :]
    return emb.cos(), emb.sin()


def _rope_at(x: torch.Tensor, pos: torch.Tensor, theta: float, tables=None) -> torch.Tensor:
    """x [r, H, D] rotated at positions pos [r] (the rotate-half convention of model.apply_rope)."""
    cos, sin = tables if tables is not None else _rope_tables(pos, x.shape[-1], theta)
    return _rope(x, cos, sin)


class AttentionCheckProbe(Probe):
    name = "attention"
    description = "every forward: one layer, one request row, attention recomputed from its own inputs and pages"

    def __init__(self, seed: int = 0, max_rows: int = 8, tolerance: float | None = None,
                 max_history: int = 100_000, **params):
        super().__init__(seed=seed, max_rows=max_rows, tolerance=tolerance, max_history=max_history, **params)
        if not isinstance(max_rows, int) or max_rows < 2:
            raise ValueError(f"max_rows must be an int >= 2 (a prefill's first and last row), got {max_rows!r}")
        rng = np.random.default_rng(seed)
        self._offset = int(rng.integers(1 << 16))       # where the rotation starts
        self.max_rows, self._tol, self.max_history = max_rows, tolerance, max_history
        self.forwards = 0
        self.checks = 0
        self.pictures: dict = {}         # (kind, request, layer) -> the weights figure()'s picture draws
        self._plan = None
        self._q = None
        self._tol_for: dict = {}
        self._views = native.CacheViews()       # the caches as numpy, per layer (the compiled check reads them)

    def on_attach(self, engine) -> None:
        self._tap = _Tap(self.guard(self._on_q), self.guard(self._on_kv), self.guard(self._on_out),
                         self.guard(self._on_hidden), self.guard(self._forward_layers))
        instrumentation.add_tap(engine, self._tap)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._plan, self._q = None, None          # nothing of a half-seen forward outlives the engine
        self._views.clear()                       # nor its caches

    def reset(self) -> None:
        super().reset()
        self.checks = self.forwards = 0
        self.pictures.clear()
        self._views.clear()

    def tolerance(self) -> float:
        if self._tol is not None:
            return float(self._tol)
        dts = (self.engine.model.dtype, self.engine.kv.k[0].dtype)
        got = self._tol_for.get(dts)                    # asked every forward: kept per (model, cache) dtype
        if got is None:
            got = self._tol_for[dts] = max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16])[0] for d in dts)
        return got

    # ---- taps ------------------------------------------------------------------------------
    def _forward_layers(self, batch):
        """Once per forward: pick the row and layer; the hooks then call the taps at that layer and
        the one before it (whose hidden state is the checked layer's input) only."""
        self._q = None
        self.forwards += 1
        p = self._plan = self._pick(batch)
        if p is None:
            return ()
        return (p["layer"] - 1, p["layer"]) if p["layer"] else (0,)

    def _on_q(self, layer, q) -> None:
        self._q = (layer, q)

    def _on_hidden(self, layer, h, batch) -> None:
        p = self._plan
        if p is not None and layer == p["layer"] - 1:       # the input of the checked layer
            p["h"] = h.index_select(0, p["abs_rows"])        # a copy: the model writes h on

    def _on_kv(self, layer, k, v, batch) -> None:
        q, self._q = self._q, None
        p = self._plan
        if p is None or layer != p["layer"]:
            return
        a, b = p["row"], p["row"] + p["n"]
        if layer == 0:
            m = self.engine.model
            p["h"] = F.embedding(batch.input_ids.index_select(0, p["abs_rows"]), m.embed).to(m.dtype)
        # views, not copies: the layer's q / k / v buffers live, unchanged, until its attention output
        p["k"], p["v"] = fast.view_rows(k, a, b), fast.view_rows(v, a, b)
        p["q"] = (fast.rows(q[1], p["rows_np"], p["abs_rows"]) if q is not None and q[0] == layer else None)

    def _on_out(self, layer, o, batch) -> None:
        p = self._plan
        if p is None or layer != p["layer"]:
            return
        self._plan = None
        p["o"] = fast.rows(o, p["rows_np"], p["abs_rows"])
        self._check(p)

    # ---- which row, which layer ------------------------------------------------------------
    def _pick(self, batch):
        if getattr(self.engine, "parallel", None) is not None:
            return None          # tensor parallel: each rank holds a share of the heads (rank_consistency's domain)
        seqs = batch.seqs
        ns, starts = scheduled_rows(self.engine, batch)
        ps, npages = batch.page_size, self.engine.kv.k[0].shape[0]
        by_kind: dict[str, list] = {k: [] for k in KINDS}
        for i, (s, n) in enumerate(zip(seqs, ns)):
            if n >= 1:
                by_kind["decode" if n == 1 else "chunk" if s.num_computed_tokens else "prefill"].append(i)
        nl = self.engine.model_config.num_layers
        f = self.forwards - 1 + self._offset
        want = (f + f // nl) % 3
        i = None
        for j in range(3):
            # the pick, then whether it can be checked (its pages and tokens cover its context): asked of the
            # one picked, not of every row (~4 us a row, cold), the next pick where it cannot
            cand = by_kind[KINDS[(want + j) % 3]]
            while cand:
                if (f // 3) % 2 == 0:                       # the longest context: most pages walked
                    c = max(cand, key=lambda c: seqs[c].num_computed_tokens + ns[c])
                else:
                    c = cand[(f // 6) % len(cand)]
                if checkable(seqs[c], ns[c], ps, npages):
                    i = c
                    break
                cand.remove(c)
            if i is not None:
                break
        if i is None:
            return None
        kind = KINDS[(want + j) % 3]
        s, n = seqs[i], ns[i]
        sel = self._rows(n, f)
        dev = batch.input_ids.device
        rows = sel + int(starts[i])                         # the checked rows' places in the packed batch
        on = (lambda a: torch.from_numpy(a)) if dev.type == "cpu" else (lambda a: torch.from_numpy(a).to(dev))
        return {"seq": s, "batch": batch, "index": i, "row": int(starts[i]), "n": n, "start": s.num_computed_tokens,
                "kind": kind, "layer": f % nl, "sel": on(sel), "sel_np": sel, "rows_np": rows,
                "abs_rows": on(rows), "step": self.engine.step_count}

    def _rows(self, n: int, f: int) -> np.ndarray:
        """The query rows of an n-row chunk to check (attention_math.sample_rows): a bug at one row offset
        (a page boundary inside the chunk, say) is met within n / max_rows checks of such chunks."""
        return sample_rows(n, f, self.max_rows)

    # ---- the check -------------------------------------------------------------------------
    def _check(self, p) -> None:
        # (inside the model's forward, under its inference_mode: no grad context entered here, ~20 us cold;
        # the torch recompute of a failing check enters its own)
        t0 = time.perf_counter()
        tol = self.tolerance()
        errs, found = self._clean_errors(p, tol), None
        if errs is None:                 # an error over its tolerance (or NaN): torch recomputes and explains it
            errs, found = self._check_torch(p, tol)
        dt = time.perf_counter() - t0
        self.checks += 1
        self.rows.append({"step": p["step"], "request_id": p["seq"].request_id, "layer": p["layer"],
                          "kind": p["kind"], "ctx": p["start"] + p["n"], "rows": len(p["sel_np"]),
                          "err_write": errs["write"], "err_rope": errs.get("rope"), "err_read": errs.get("read"),
                          "tolerance": tol, "tolerance_rope": tol * ROPE_MARGIN, "bad": found, "us": dt * 1e6})
        if len(self.rows) > self.max_history:           # a probe must not become the leak it hunts
            del self.rows[: len(self.rows) // 2]

    def _clean_errors(self, p, tol) -> dict | None:
        """The three errors (attention_numpy.py's formulas; compiled where attention_native applies), or None
        when one is over its tolerance or NaN."""
        eng = self.engine
        mod = native.module(eng.kv.k[p["layer"]], eng.model.dtype)
        errs = self._compiled_errors(mod, p) if mod is not None else self._numpy_errors(p)
        ok = (errs["write"] <= tol and errs.get("rope", 0.0) <= tol * ROPE_MARGIN
              and errs.get("read", 0.0) <= tol)                      # NaN fails every comparison
        return errs if ok else None

    def _compiled_errors(self, mod, p) -> dict:
        """write and read in one call (the request's pages read in place, no gathered copy); rope in two
        more (the norm and the rotation; the qkv projection is the layer's own linear)."""
        eng = self.engine
        m, cfg, kv = eng.model, eng.model.cfg, eng.kv
        start, L = p["start"], p["layer"]
        ctx = start + p["n"]
        pos = p["sel_np"] + start
        k_np, v_np = self._views.get(kv.k[L], kv.v[L], L)
        write, read = native.check(mod, k_np, v_np, p["seq"].pages[: -(-ctx // kv.page_size)], ctx, start,
                                   p["k"], p["v"], p["q"], p["o"], pos, cfg.head_dim ** -0.5)
        errs = {"write": write} if read is None else {"write": write, "read": read}
        if p.get("h") is not None:
            Ly = m.layers[L]
            qkv = fast.view(Ly.qkv(native.rms_norm(mod, p["h"], Ly.norm_attn, cfg.rms_norm_eps)))
            errs["rope"] = native.rope(mod, qkv, m.q_size, m.kv_size, cfg.head_dim, cfg.rope_theta, p["q"],
                                       p["k"][p["sel_np"]], pos)
        return errs

    def _numpy_errors(self, p) -> dict:
        """The same three errors in numpy (attention_numpy.py): a cache that is not plain CPU float32, or
        no compiled module."""
        eng = self.engine
        m, cfg, kv = eng.model, eng.model.cfg, eng.kv
        seq, start, L = p["seq"], p["start"], p["layer"]
        ctx, hd = start + p["n"], cfg.head_dim
        npg = -(-ctx // kv.page_size)
        pos = p["sel_np"] + start
        ks, vs = fast.stored(kv.k[L], seq.pages[:npg], ctx), fast.stored(kv.v[L], seq.pages[:npg], ctx)
        errs = {"write": max(fast.rel(ks[start:], p["k"]), fast.rel(vs[start:], p["v"]))}
        if p.get("h") is not None:
            Ly = m.layers[L]
            qkv = fast.view(Ly.qkv(fast.rms_norm(p["h"], Ly.norm_attn, cfg.rms_norm_eps)))
            q_raw = qkv[:, : m.q_size].reshape(len(pos), cfg.num_heads, hd)
            k_raw = qkv[:, m.q_size: m.q_size + m.kv_size].reshape(len(pos), cfg.num_kv_heads, hd)
            eq = fast.rel(p["q"], fast.rope_at(q_raw, pos, cfg.rope_theta)) if p["q"] is not None else 0.0
            errs["rope"] = max(eq, fast.rel(p["k"][p["sel_np"]], fast.rope_at(k_raw, pos, cfg.rope_theta)))
        if p["q"] is not None:
            kr, vr = (ks, vs) if start else (p["k"], p["v"])     # a whole prompt attends to what it computed
            errs["read"] = fast.rel(p["o"], fast.attend(p["q"], kr, vr, pos, hd ** -0.5))
        return errs

    @torch.no_grad()
    def _check_torch(self, p, tol) -> tuple[dict, str | None]:
        """The check in torch, with its findings: run when the numpy errors say something is wrong."""
        eng = self.engine
        dev = eng.kv.k[p["layer"]].device
        for key in ("k", "v", "q", "o"):
            if isinstance(p.get(key), np.ndarray):
                p[key] = torch.from_numpy(p[key]).to(dev)
        m, cfg, kv = eng.model, eng.model.cfg, eng.kv
        seq, start, n, L = p["seq"], p["start"], p["n"], p["layer"]
        ctx, ps = start + n, kv.page_size
        hd = cfg.head_dim
        pages = torch.tensor(seq.pages[: -(-ctx // ps)], dtype=torch.long, device=kv.k[L].device)
        ks, vs = self._stored(kv.k[L], pages, ctx), self._stored(kv.v[L], pages, ctx)
        sel, pos = p["sel"], p["sel"] + start
        p["k"], p["v"] = p["k"].float(), p["v"].float()
        errs = {"write": max(float(_rel_rows(ks[start:], p["k"]).max()), float(_rel_rows(vs[start:], p["v"]).max()))}
        found = None
        if errs["write"] > tol:
            found = self._report_write(p, ks[start:], vs[start:], tol)
        Ly = m.layers[L]
        if p.get("h") is not None:
            qkv = Ly.qkv(_rms(p["h"], Ly.norm_attn, cfg.rms_norm_eps)).float()
            q_raw = qkv[:, : m.q_size].view(len(sel), cfg.num_heads, hd)
            k_raw = qkv[:, m.q_size: m.q_size + m.kv_size].view(len(sel), cfg.num_kv_heads, hd)
            tables = _rope_tables(pos, hd, cfg.rope_theta)            # q and k share the positions
            want_q, want_k = _rope_at(q_raw, pos, cfg.rope_theta, tables), _rope_at(k_raw, pos, cfg.rope_theta, tables)
            k_sel = p["k"].index_select(0, sel)
            eq = _rel_rows(p["q"], want_q) if p["q"] is not None else torch.zeros(len(sel))
            ek = _rel_rows(k_sel, want_k)
            errs["rope"] = max(float(eq.max()), float(ek.max()))
            if found is None and errs["rope"] > tol * ROPE_MARGIN:
                found = self._report_rope(p, q_raw, k_raw, p["q"], k_sel, eq, ek, tol * ROPE_MARGIN)
        if p["q"] is not None:
            keys = torch.arange(ctx, device=ks.device)[None, :]
            allowed = keys <= pos[:, None]
            kr, vr = (ks, vs) if start else (p["k"], p["v"])     # a whole prompt attends to what it computed
            want = _attend(p["q"], kr, vr, allowed, hd ** -0.5)
            err = _rel_rows(p["o"], want)
            errs["read"] = float(err.max())
            if found is None and errs["read"] > tol:
                found = self._report_read(p, err, want, kr, vr, pages, tol)
        return errs, found

    def _stored(self, cache: torch.Tensor, pages: torch.Tensor, ctx: int) -> torch.Tensor:
        return stored_kv(cache, pages, ctx)

    # ---- findings --------------------------------------------------------------------------
    def _where(self, p, pos: int) -> tuple[int, dict]:
        seq, ps = p["seq"], self.engine.kv.page_size
        page = int(seq.pages[pos // ps])
        return page, {"position": pos, "page": page, "page_index": pos // ps, "offset": pos % ps,
                      "token_id": int(seq.token_ids[pos]), "layer": p["layer"], "row_kind": p["kind"],
                      "query_start": p["start"], "context": p["start"] + p["n"],
                      "user_request_id": getattr(seq, "user_request_id", None)}

    def _emit(self, p, kind, pos, what, hint, evidence, **extra) -> str:
        rid, L = p["seq"].request_id, p["layer"]
        page, ev = self._where(p, pos)
        ev.update(evidence)
        self.report("error", f"request {rid}, layer {L}, position {pos} (page {page}, {p['kind']} row): {what}",
                    hint, kind=kind, dedup=(kind, rid, L), step=p["step"], request_id=rid, layer=L, page=page,
                    evidence=ev, **extra)
        return kind

    def _report_write(self, p, ks, vs, tol) -> str:
        ek, ev = _rel_rows(ks, p["k"]), _rel_rows(vs, p["v"])
        r = int(torch.nonzero((ek > tol) | (ev > tol))[0])
        bad_k = bool(ek[r] > tol)
        got, handed = (ks[r], p["k"][r]) if bad_k else (vs[r], p["v"][r])
        wrong = [int(h) for h in torch.nonzero(_head_err(got[None], handed[None]) > tol).flatten()]
        # whose values do the wrong heads hold? another head of the same token: heads permuted
        norm = handed.abs().amax().clamp_min(1e-30)
        holds = {h: int(((got[h][None] - handed).abs().amax(-1) / norm).argmin()) for h in wrong}
        permuted = all(float((got[h] - handed[j]).abs().amax() / norm) <= tol and j != h for h, j in holds.items())
        explain = (f"heads stored in another order (stored head -> the head it holds: "
                   f"{', '.join(f'{h}->{j}' for h, j in holds.items())})" if permuted and wrong else
                   "not the values computed for this token")
        return self._emit(p, "attention-write", p["start"] + r,
                          f"the {'K' if bad_k else 'V'} stored at its slot differs from what the layer handed to "
                          f"the write in head(s) {wrong} (error {float(max(ek[r], ev[r])):.3g} x max, tolerance "
                          f"{tol:.1g}): {explain}",
                          HINT_WRITE, {"check": "write", "tensor": "K" if bad_k else "V", "heads": wrong,
                                       "err": float(max(ek[r], ev[r])), "tolerance": tol,
                                       "rows_wrong": int(((ek > tol) | (ev > tol)).sum()),
                                       **({"heads_hold": holds} if permuted and wrong else {})})

    def _report_rope(self, p, q_raw, k_raw, q, k, eq, ek, tol) -> str:
        r = int(torch.nonzero((eq > tol) | (ek > tol))[0])
        pos = int(p["sel"][r]) + p["start"]
        which, raw, got = ("q", q_raw, q) if bool(eq[r] > tol) else ("k", k_raw, k)
        theta = self.engine.model_config.rope_theta
        tries = {pos + d: float(_rel_rows(got[r][None], _rope_at(raw[r][None],
                                                                   torch.tensor([pos + d], device=raw.device),
                                                                   theta)).max())
                 for d in range(-4, 5) if d and pos + d >= 0}
        at = min(tries, key=tries.get)
        explain = (f"it was rotated at position {at}: a RoPE position slip" if tries[at] <= tol
                   else "it is not the layer's projection of its input rotated at any nearby position")
        return self._emit(p, "attention-rope", pos,
                          f"{which} differs from the layer's own projection rotated at the row's position "
                          f"(error {float(max(eq[r], ek[r])):.3g} x max, tolerance {tol:.1g}): {explain}",
                          HINT_ROPE, {"check": "rope", "tensor": which, "err": float(max(eq[r], ek[r])),
                                      "tolerance": tol, **({"rotated_at_position": at} if tries[at] <= tol else {})})

    def _report_read(self, p, err, want, kr, vr, pages, tol) -> str:
        q, got, sel, start = p["q"], p["o"], p["sel"], p["start"]
        r = int(torch.nonzero(err > tol)[0])
        pos = int(sel[r]) + start
        heads = [int(h) for h in torch.nonzero(_head_err(got, want) > tol).flatten()]
        match = self._explain(p, q, got, kr, vr, pages, heads, tol)
        key = ("attention-read", p["seq"].request_id, p["layer"])
        pic = None
        if key not in self.pictures and len(self.pictures) < MAX_PICTURES:
            pic = self.pictures[key] = self._picture(p, q, kr, vr, pos, r, match[2] if match else None)
        return self._emit(p, "attention-read", pos,
                          f"paged attention output differs from float32 attention over the request's own stored "
                          f"K/V in head(s) {heads} (error {float(err[r]):.3g} x max, tolerance {tol:.1g}, "
                          f"{int((err > tol).sum())}/{len(sel)} rows checked)"
                          + (f"; it matches {match[1]}" if match else "; no nearby explanation matches"),
                          HINT_READ, {"check": "read", "heads": heads, "err": float(err[r]), "tolerance": tol,
                                      "rows_wrong": int((err > tol).sum()), "rows": len(sel),
                                      **({"picture": pic} if pic is not None else {}),
                                      **({"explanation": match[0], "matches": match[1]} if match else {})})

    def _explain(self, p, q, got, kr, vr, pages, heads, tol):
        """The nearest explanation of a bad read whose output it reproduces: (kind, words, the
        attention's inputs that reproduce it) or None. The model-level tries are attention_math's
        (mask, scale, GQA map, a page left out or read from its neighbour); then the pages the
        batch's block table names in place of the request's own."""
        cfg, kv = self.engine.model.cfg, self.engine.kv
        scale = cfg.head_dim ** -0.5
        ctx, npg = kr.shape[0], -(-kr.shape[0] // kv.page_size)
        found = explain_read(q, got, kr, vr, p["sel"] + p["start"], scale, tol, heads=heads,
                             page_size=kv.page_size, pages=pages, start=p["start"])
        if found is not None:
            return found
        allowed = causal(p["sel"] + p["start"], ctx)
        bt = p["batch"].block_tables
        if p["start"] and bt is not None and p["index"] < bt.shape[0] and bt.shape[1] >= npg:
            row = bt[p["index"], :npg].to(pages.device).long()      # the pages the kernel was pointed at
            if not torch.equal(row, pages) and bool(((row >= 0) & (row < kv.k[0].shape[0])).all()):
                L = p["layer"]
                kb, vb = self._stored(kv.k[L], row, ctx), self._stored(kv.v[L], row, ctx)
                if float(_rel_rows(got, _attend(q, kb, vb, allowed, scale)).max()) <= tol:
                    diff = [(i, int(row[i]), int(pages[i])) for i in range(npg) if int(row[i]) != int(pages[i])]
                    return "block-table", ("attention over the pages the batch's block table names instead of the "
                                           "request's own (" + ", ".join(f"index {i}: page {a}, not {b}"
                                                                        for i, a, b in diff[:4]) + ")"), \
                        {"k": kb, "v": vb}
        return None

    def _picture(self, p, q, kr, vr, pos: int, r: int, explained: dict | None) -> dict:
        """Row r's attention weights per query head over the context (attention_math.picture, the schema
        the vLLM plugin's findings carry too)."""
        return _picture_of(q, kr, r, pos, self.engine.model.cfg.head_dim ** -0.5, explained=explained,
                           page_size=self.engine.kv.page_size)

    def figure(self, finding):
        """The picture of one of this probe's `attention-read` findings: per query head, the attention
        weights over the context the model means (float32 over the request's own pages) and, when an
        explanation reproduced the kernel's output, the weights the kernel attended with."""
        pic = self.pictures.get((finding.kind, finding.request_id, finding.layer))
        if pic is None:
            raise KeyError(f"no picture for this finding ({finding.kind}, request {finding.request_id}, layer "
                           f"{finding.layer}): pictures are kept for this probe's attention-read findings")
        return attention_figure(finding, pic)

    # ---- views -------------------------------------------------------------------------------
    def widget(self):
        """Error of each check against its tolerance, by step (log scale)."""
        import plotly.express as px
        df = self.frame()
        if df.empty:
            return px.scatter(title=f"{self.name}: no checks yet")
        return px.scatter(df, x="step", y=["err_write", "err_rope", "err_read", "tolerance"], log_y=True,
                          hover_data=["request_id", "layer", "kind", "ctx"], title="attention check, every forward")
