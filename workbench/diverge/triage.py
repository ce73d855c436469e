"""triage(a, b, prompts): which request and token first went wrong, and was it drift or corruption.

1. Side A runs the prompts greedy: the reference tokens.
2. Side B runs teacher-forced on A's tokens through its own serving path (for an Engine: its
   pages, prefix cache and batching, SamplingParams.forced_token_ids), giving per position the
   log-prob of A's token and B's own top tokens.
3. The noise floor, measured: each side runs A's tokens again for a sample of the requests
   (`floor_sample`, 8) in another batch composition and order (see _repeat); the 99th percentile of a side's repeat differences is its
   numeric noise, and the quieter side's is the pair's `floor` (a side that does not repeat itself
   beyond that is named in the summary: a bug that depends on batching does that). A near tie is a
   top-2 margin under `tie` = max(0.5 nats, 8 x floor).
4. Per token: delta = |log-prob of A's token on A - on B|; B *flips* where its top token is not A's.
   A token is **corrupt** when both sides were sure and disagree: A's margin > tie and B prefers
   another token by more than tie (or puts A's token more than 2 x tie lower than A did, at a token A
   was sure of); or when its delta is JUMP (100) times the pair's typical one (the median delta over
   every token, at least the floor) and over MIN_JUMP: two implementations differ a little everywhere,
   a wrong K/V differs a lot somewhere. Per request: `identical` (no flip, every delta within the floor), `corruption` (a
   corrupt token: the first one is named), else `drift` (flips only at near ties, or small differences
   everywhere: bf16 vs fp32, another page size, batch shape, transformers vs us).

A flight recording (workbench.recorder, ours or vLLM's; a path or RecordingSide) can be side A: its
greedy requests' prompts and the tokens production produced, judged by B alone (`_one_sided`: a
recorded token B rejects by more than 2 x tie is corruption), the floor B's own repeat noise.

`report.frame()`: one row per request (request, verdict, first_token, layer, pages, evidence). For a
corrupt request on a side we can tap (our engine), localize.py runs it again to that token and asks
the shadow probe for a dense recompute through every layer: the first layer and page it finds wrong
fill `layer` and `pages` (None where it finds nothing, or for transformers on both sides).
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field

import numpy as np

from .sides import EngineSide, HFSide, Run

JUMP = 100          # a token whose difference is this many times the pair's typical one is not numeric
MIN_JUMP = 0.05     # nats: below this no single token is called corrupt on size alone


@dataclass
class TriageReport:
    a: str
    b: str
    floor: float
    tie: float
    scale: float = 0.0                                         # the pair's typical (median) difference
    jump: float = 0.0                                          # a difference this big is corruption
    repeat_noise: dict = field(default_factory=dict)          # side -> its own repeat noise (99th pct)
    rows: list[dict] = field(default_factory=list)
    per_token: list[dict] = field(default_factory=list)      # request -> arrays (delta, margins, flips)
    seconds: dict = field(default_factory=dict)               # phase -> wall seconds (where the time went)
    tokens: list = field(default_factory=list)                # per request, A's tokens (what B was forced on)
    curves: dict = field(default_factory=dict)                # request -> layers.curve_from() at its first bad token
    faults: dict = field(default_factory=dict)                # request -> the localising finding's evidence

    def frame(self):
        import pandas as pd
        return pd.DataFrame(self.rows, columns=["request", "verdict", "first_token", "layer", "pages", "evidence"])

    def strip(self):
        """Per request, per output token: the difference between the sides (log10 nats), a cell per
        token, corrupt tokens ringed in red, near ties (A's margin under `tie`) dimmed; plotly."""
        import plotly.graph_objects as go
        n = max((len(t["delta"]) for t in self.per_token), default=0)
        z = np.full((len(self.per_token), n), np.nan)
        for i, t in enumerate(self.per_token):
            d = np.nan_to_num(np.asarray(t["delta"], dtype=float), nan=1e3, posinf=1e3)
            z[i, :len(d)] = np.log10(np.maximum(d, 1e-9))
        fig = go.Figure(go.Heatmap(z=z, colorscale="RdYlGn_r", zmin=-9, zmax=1,
                                   colorbar={"title": "log10 |diff| (nats)"},
                                   hovertemplate="request %{y}, token %{x}: 10^%{z:.1f} nats<extra></extra>"))
        xs, ys = [], []
        for i, t in enumerate(self.per_token):
            for j in np.nonzero(t["corrupt"])[0]:
                xs.append(int(j))
                ys.append(i)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name="corrupt",
                                 marker={"symbol": "square-open", "size": 12, "color": "red", "line": {"width": 2}}))
        fig.update_layout(title=f"{self.a} vs {self.b}: {self.summary().split(': ', 1)[1]}", xaxis_title="output token",
                          yaxis_title="request", height=120 + 28 * len(self.per_token))
        return fig

    def layer_curve(self, request: int):
        """The corrupt request's relative hidden-state difference per layer at its first bad token,
        and at the token before (each layer's floor); log scale; plotly."""
        import plotly.graph_objects as go
        c = self.curves.get(request)
        if c is None:
            raise KeyError(f"request {request}: no layer curve (not corrupt, not localised, or a side that "
                           f"cannot be tapped); curves for {sorted(self.curves)}")
        layers = list(range(len(c["at"])))
        cap = lambda x: np.minimum(np.maximum(np.asarray(x, dtype=float), 1e-9), 1e3)   # inf (NaN) drawn at the top
        row = next(r for r in self.rows if r["request"] == request)
        fig = go.Figure([go.Scatter(x=layers, y=cap(c["at"]), mode="lines+markers", name=f"token {row['first_token']}"),
                         go.Scatter(x=layers, y=cap(c["floor"]), mode="lines+markers", name="token before (floor)",
                                    line={"dash": "dot"})])
        if c["layer"] is not None:
            fig.add_vline(x=c["layer"], line_color="red", annotation_text=f"parts at layer {c['layer']}")
        fig.update_layout(title=f"request {request}: |h_{self.a} - h_{self.b}| / |h_{self.a}| per layer",
                          xaxis_title="layer", yaxis_title="relative difference", yaxis_type="log")
        return fig

    def page_map(self, request: int):
        """The corrupt request's context as its pages (a row per page of its page table, a cell per
        slot): the position the localising probe names in red, and for a bad read every query row
        from there on (orange); plotly. From the shadow probe's finding at the first bad token."""
        import plotly.graph_objects as go
        f = self.faults.get(request)
        if f is None:
            raise KeyError(f"request {request}: nothing localised to pages; localised: {sorted(self.faults)}")
        ev, ps = f.get("evidence") or {}, int(f.get("page_size") or 16)
        row = next(r for r in self.rows if r["request"] == request)
        ctx = max([int(ev.get("context") or 0), *(p + 1 for p in f.get("positions") or [0])])
        n = -(-ctx // ps)
        z = np.zeros((n, ps))
        z.flat[ctx:] = np.nan                                           # past the context
        for p in f.get("positions") or ():
            z.flat[p] = 2
        first = ev.get("position")
        if "rows_wrong" in ev and first is not None:                    # a bad read: every row from there on
            z.flat[int(first):ctx] = np.maximum(z.flat[int(first):ctx], 1)
        fig = go.Figure(go.Heatmap(z=z, zmin=0, zmax=2, colorscale=[[0, "#e8f0e8"], [0.5, "#f5b041"], [1, "#c0392b"]],
                                   showscale=False, xgap=1, ygap=1,
                                   hovertemplate="page index %{y}, offset %{x}<extra></extra>"))
        also = f" (engine request {f['engine_request_id']})" if f.get("engine_request_id") is not None else ""
        fig.update_layout(title=f"request {request}{also}, layer {row['layer']}: {f['kind']} "
                                f"(page {ev.get('page')}, position {first}); pages {row['pages']}",
                          xaxis_title="offset in page", yaxis_title="page index in its page table",
                          yaxis_autorange="reversed", height=160 + 22 * n)
        return fig

    def summary(self) -> str:
        v = [r["verdict"] for r in self.rows]
        loud = [s for s, x in self.repeat_noise.items() if x > self.jump]
        return (f"{self.a} vs {self.b}: {v.count('identical')} identical, {v.count('drift')} drift, "
                f"{v.count('corruption')} corruption (floor {self.floor:.2e} nats, near tie < {self.tie:.2f})"
                + "".join(f"; {s} is not reproducible across batch compositions ({self.repeat_noise[s]:.2f} nats)"
                          for s in loud))


def as_side(x, name: str):
    if hasattr(x, "run"):
        return x
    if isinstance(x, str) and x.startswith(("http://", "https://")):
        from .sides import VllmSide
        return VllmSide(x, name=name)
    from ..engine import Engine
    if isinstance(x, Engine):
        return EngineSide(x, name=name)
    from ..recorder.reader import is_recording
    if is_recording(x):
        from .sides import RecordingSide
        return RecordingSide(x)
    return HFSide(x, name=name)


def _localize(rep, row, A, B, prompts, tokens, i: int, t: int) -> None:
    """A corrupt request's layer and pages. Each engine side is re-run once to that token
    (localize.forced_run): the layer curve's hidden states and, on the first side whose check finds
    something (B first, the side under suspicion; a clean side finds nothing), the shadow probe's dense
    recompute through every layer: the layer and pages it finds wrong, and the probe that should have
    caught it. Transformers sides give their hidden states through forward hooks."""
    from .layers import curve_from, curve_tokens, hf_hidden
    from .localize import forced_run
    want = curve_tokens(t)
    hidden: dict = {}
    found = by = None
    for side in (B, A):
        if isinstance(side, EngineSide):
            hidden[id(side)], f = forced_run(side.engine, prompts, tokens, i, want, shadow=found is None)
            if found is None and f is not None:
                found, by = f, side
        elif isinstance(side, HFSide):
            hidden[id(side)] = hf_hidden(side.model, prompts[i], tokens[i], want)
    if id(A) in hidden and id(B) in hidden:
        curve = rep.curves[i] = curve_from(hidden[id(A)], hidden[id(B)], t)
        L = curve["layer"]
        if L is not None:
            row["layer"] = L
            row["evidence"] += (f"; hidden states part at layer {L} (hidden {curve['at'][L]:.1e} relative, floor "
                                f"{curve['floor'][L]:.1e}; attention output {curve['attn_at'][L]:.1e}, floor "
                                f"{curve['attn_floor'][L]:.1e})")
    if found is None:
        return
    # one name per screen: the probe named the re-run's engine request; the table, the strip and the page
    # map name the triage's request i. The message says both, once.
    rid = found.get("engine_request_id")
    if rid is not None:
        found["message"] = re.sub(rf"\brequest {re.escape(str(rid))}\b", f"request {i} (engine request {rid})",
                                  found["message"], count=1)
    rep.faults[i] = found
    row["pages"] = found["pages"]
    if row["layer"] is None:
        row["layer"] = found["layer"]
    row["evidence"] += f"; {by.name}'s shadow check there ({found['probe']} probe, {found['kind']}): {found['message']}"


class _Clock:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str, fn, *a, **kw):
        import time
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def _sample(n: int, k: int) -> list[int]:
    """k requests spread over the n, last first (the repeat's order is the reverse of the run's)."""
    k = max(1, min(n, k))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, k)}, reverse=True)


def _repeat(side, prompts, tokens, sample) -> Run:
    """The side again, teacher-forced on the same tokens, for the `sample` requests in another batch
    composition and order: reversed, all together when they are a subset (other batch partners and
    size), else in halves. The noise floor needs thousands of tokens, not every request: the cost
    stays a fraction of one pass (64 x 256 tokens: 4 requests repeated)."""
    size = len(sample) if len(sample) < len(prompts) else max(1, len(sample) // 2)
    return side.run([prompts[i] for i in sample], 0, forced=[tokens[i] for i in sample], batch=size)


def _pick(run: Run, idx) -> Run:
    return Run([run.tokens[i] for i in idx], [run.logprob[i] for i in idx],
               [run.top[i] for i in idx] if run.top else [], [run.top_lp[i] for i in idx] if run.top_lp else [])


def _tie(floor: float) -> float:
    """A top-2 margin under this is a near tie: 0.5 nats, or 8 x the noise floor where that is more."""
    return max(0.5, 8 * floor)


def _noise(r1: Run, r2: Run) -> float:
    """A side's repeat noise: the 99th percentile of its per-token differences between two runs."""
    d = np.nan_to_num(_delta(r1, r2), nan=1e9, posinf=1e9)
    return float(np.quantile(d, 0.99)) if len(d) else 0.0


def _delta(r1: Run, r2: Run) -> np.ndarray:
    return np.concatenate([np.abs(a - b) for a, b in zip(r1.logprob, r2.logprob)]) if r1.logprob else np.zeros(0)


FLOOR_TOKENS = 1024     # tokens the noise floor's 99th percentile is taken over (a sample of requests)


def triage(a, b, prompts=None, max_tokens: int = 32, localize: int = 4, floor_sample: int | None = None) -> TriageReport:
    """localize: how many corrupt requests to localise to a layer and pages (on a side we can tap).
    floor_sample: how many requests each side repeats for its noise floor (see _repeat); default
    enough for FLOOR_TOKENS tokens, at least 2.
    A recording (a path, or RecordingSide) is always the reference: it brings its own prompts
    (`prompts` None) and is judged by the other side alone (see _one_sided)."""
    A, B = as_side(a, "A"), as_side(b, "B")
    if not getattr(B, "has_logprobs", True) and getattr(A, "has_logprobs", True):
        A, B = B, A                                  # the recording is the reference
    if not getattr(B, "has_logprobs", True):
        raise ValueError(f"{A.name} vs {B.name}: two recordings cannot be compared token by token "
                         "(neither can be teacher-forced); compare each with an engine")
    recorded = not getattr(A, "has_logprobs", True)
    if recorded:
        prompts = A.prompts                          # a recording's own requests, whatever was passed
    elif prompts is None:
        raise ValueError("triage: prompts are needed unless one side is a recording")
    n = len(prompts)
    clock = _Clock()
    ref = clock("A greedy", A.run, prompts, max_tokens)
    tokens = ref.tokens
    fb = clock("B teacher-forced", B.run, prompts, max_tokens, forced=tokens)
    per = max(1, int(np.mean([len(t) for t in tokens])) if tokens else 1)
    sample = _sample(n, floor_sample or max(2, -(-FLOOR_TOKENS // per)))
    b2 = clock("B repeat", _repeat, B, prompts, tokens, sample)
    if recorded:
        rep = _one_sided(A, B, ref, fb, b2, sample)
        rep.seconds, rep.tokens = clock.seconds, tokens
        return rep
    a2 = clock("A repeat", _repeat, A, prompts, tokens, sample)
    # each side's repeat noise; the pair's floor is the quieter side's: a side whose own repeat differs
    # beyond it is not reproducible across batch compositions (itself a symptom, said in the report)
    na, nb = _noise(_pick(ref, sample), a2), _noise(_pick(fb, sample), b2)
    floor = min(na, nb)
    tie = _tie(floor)
    rep = TriageReport(getattr(A, "name", "A"), getattr(B, "name", "B"), floor, tie)
    rep.repeat_noise = {rep.a: na, rep.b: nb}
    rep.seconds, rep.tokens = clock.seconds, tokens
    # the pair's typical difference (the median over every token): two implementations (bf16 and fp32,
    # transformers and us) differ everywhere a little; corruption differs at some tokens by far more
    every = _delta(ref, fb)
    finite = every[np.isfinite(every)]
    scale = max(floor, float(np.median(finite)) if len(finite) else 0.0)
    jump = max(JUMP * scale, MIN_JUMP)
    rep.scale, rep.jump = scale, jump
    for i in range(n):
        lp_a, lp_b = ref.logprob[i], fb.logprob[i]
        delta = np.abs(lp_a - lp_b)
        margin_a = ref.margin(i)
        b_top = fb.top[i][:, 0] if len(fb.top[i]) else np.zeros(0, dtype=int)
        b_pref = fb.top_lp[i][:, 0] - lp_b                       # how much B prefers its top over A's token
        flips = b_top != np.asarray(tokens[i])
        with np.errstate(invalid="ignore"):
            corrupt = ((margin_a > tie) & (((b_pref > tie) & flips) | (lp_a - lp_b > 2 * tie))) | (delta > jump)
        corrupt |= ~np.isfinite(lp_b) & np.isfinite(lp_a)      # NaN / inf where A was finite: never numeric
        if corrupt.any():
            t = int(np.argmax(corrupt))
            verdict = "corruption"
            size = (f"{delta[t] / max(scale, 1e-12):.0f}x the pair's typical difference {scale:.1e}"
                    if np.isfinite(delta[t]) else f"not finite on {rep.b}")
            ev = (f"token {t} ({tokens[i][t]}): log-prob {lp_a[t]:.3f} on {rep.a}, {lp_b[t]:.3f} on {rep.b} "
                  f"({size}); {rep.a} was "
                  f"sure by {margin_a[t]:.2f} nats" + (f", {rep.b} prefers {int(b_top[t])} by {b_pref[t]:.2f}"
                                                        if flips[t] else ""))
        elif not flips.any() and (not len(delta) or delta.max() <= max(floor, 1e-6)):
            t, verdict, ev = None, "identical", f"every token within the floor (max {delta.max() if len(delta) else 0:.1e})"
        else:
            t = int(np.argmax(flips)) if flips.any() else int(np.argmax(delta))
            verdict = "drift"
            ev = (f"{int(flips.sum())} flips, none where both sides were sure (margin > {tie:.2f}); largest "
                  f"difference {delta.max():.3f} nats at token {int(np.argmax(delta))}")
        row = {"request": i, "verdict": verdict, "first_token": t, "layer": None, "pages": None, "evidence": ev}
        if verdict == "corruption" and localize > 0:
            localize -= 1
            clock("localize", _localize, rep, row, A, B, prompts, tokens, i, t)
        rep.rows.append(row)
        rep.per_token.append({"delta": delta, "margin_a": margin_a, "flips": flips, "corrupt": corrupt})
    return rep


def _one_sided(A, B, ref: Run, fb: Run, b2: Run, sample) -> TriageReport:
    """A recording against a side that can be teacher-forced on its tokens. The recording kept no
    log-probs, so B alone judges each recorded token: `pref` = how much B prefers its own top token
    over the recorded one (0 where they agree). A recorded token B rejects by more than 2 x tie
    (the two-sided rule's bound for a token A was sure of) is corruption: no numeric difference the
    floor allows moves a log-prob that far; a flip under it is drift (a near tie on B, which another
    dtype or device may break the other way). The floor is B's own repeat noise."""
    floor = _noise(_pick(fb, sample), b2)
    tie = _tie(floor)
    rep = TriageReport(A.name, B.name, floor, tie)
    rep.repeat_noise = {B.name: floor}
    rep.scale, rep.jump = floor, 2 * tie
    ids = getattr(A, "ids", None) or list(range(len(ref.tokens)))
    for i, toks in enumerate(ref.tokens):
        lp_b = fb.logprob[i]
        pref = fb.top_lp[i][:, 0] - lp_b
        flips = fb.top[i][:, 0] != np.asarray(toks)
        with np.errstate(invalid="ignore"):
            corrupt = (flips & (pref > 2 * tie)) | ~np.isfinite(lp_b)
        if corrupt.any():
            t = int(np.argmax(corrupt))
            verdict = "corruption"
            ev = (f"token {t} ({toks[t]}): {B.name} gives the recorded token {lp_b[t]:.3f} and prefers "
                  f"{int(fb.top[i][t, 0])} by {pref[t]:.2f} nats (> {2 * tie:.2f}): the recorded run computed "
                  "something else there")
        elif not flips.any():
            t, verdict = None, "identical"
            ev = f"every recorded token is {B.name}'s greedy choice (the recording keeps tokens, not log-probs)"
        else:
            t, verdict = int(np.argmax(flips)), "drift"
            ev = (f"{int(flips.sum())} recorded tokens {B.name} would not have chosen, each within a near tie "
                  f"(prefers its own by at most {float(pref[flips].max()):.2f} nats <= {2 * tie:.2f})")
        rep.rows.append({"request": ids[i], "verdict": verdict, "first_token": t, "layer": None, "pages": None,
                         "evidence": ev})
        rep.per_token.append({"delta": np.where(flips, pref, 0.0), "margin_a": np.full(len(toks), np.nan),
                              "flips": flips, "corrupt": corrupt})
    return rep
