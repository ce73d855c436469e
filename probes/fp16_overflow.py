"""fp16_overflow: how close each layer's K, V, hidden states and attention scores come to 65504.

Field note 5: a larger model answered `<unk>` and garbage in fp16 while a small one was
fine and training loss looked perfect: some layers' K/V exceed fp16's 65504, the cast
into the KV cache makes them inf, attention over inf gives NaN. This probe measures,
per layer, BEFORE the cast (what the fused store and the norms measure as they go, else the
model hooks' taps: on_kv before the KV write, on_hidden after each layer):

- absmax of K, V (per token, then per layer and per page) and of the hidden state,
  headroom = absmax / 65504, and the tokens holding inf/NaN;
- a cheap bound on the attention scores: scale * max|q| * max|k| (L2 norms per head;
  RoPE keeps them), |q| for the last token of each sequence only (recomputed from the
  layer input where the model does not hand q to its hooks and the hidden states reach the
  probe: not where the norms measure them, whose layers then have no bound), and |k| over this and the
  7 previous measured steps (the keys decodes read are mostly older than the step).

K's and V's per-token absmax and the head norms come from the fused store where it runs: it
measures them as it writes each row, and the probe reads its buffer once the layers ran (the tap's
need "row_stats": the hooks do not call on_kv / on_q at a layer the store measured, so a measured
decode forward calls no probe method between its layers); elsewhere from one pass over the
layer's K and V. Each layer's hidden state is measured by the next layer's compiled norm as it reads
it (need "hidden_absmax": the hooks hand the probe only the last layer's); elsewhere read here.

Severity follows what is actually stored in fp16: K/V over 65504 is an error in a
plain float16 KV cache, info in an fp16_scaled one (the page scales absorb it) and a
warning otherwise (it would break an fp16 deployment); likewise for hidden states and
the model dtype. inf/NaN anywhere is an error. Each finding names the FIRST layer of
the step with the problem, the page (slot // page_size) and the request of the first
offending token, and its hint points at kv_cache_dtype="fp16_scaled" (or bfloat16).

After the last layer, a measured forward of more than STASH_ROWS rows (a prefill) is read for
its sampled rows only: the model prunes the others there, and keeping them would cost about a
layer's worth of a prefill's linears; every earlier layer sees every row.

Cost: measured every `every`-th step (default 4, counted from the first step seen).
Where the store and the norms measure (the compiled CPU path), a measured step adds the last layer's
hidden state for every row, one reduction over it and a few numpy operations on the [L, T] buffers;
elsewhere per layer a few reductions over K, V and h and a norm over q, plus a device-to-host copy
of the stats and one of the per-page maxima (page_history=0 turns the pages off) per measured step;
an unmeasured step costs one Python call (forward_layers says: no layer). On SmolLM2-135M, workload A
of benchmarks/probe_overhead.py: ~0.6-0.7% of the run (every=4) until stop 56, when the probe was
called at every layer of a measured forward (~1.4 ms a decode) and read a 2048-token prefill's
hidden states itself (~15 ms); see docs/benchmarks.md for the figure now.

Kept: one entry per measured step (its per-layer arrays; frame() spreads them into a row per
layer), at most `max_history` rows (100,000: the older half dropped past it), and the per-page
maxima of the last `page_history` measured steps (64).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import instrumentation, kv_scale
from workbench.engine.attention.native import row_absmax, rows_absmax
from workbench.engine.model import rms_norm
from workbench.engine.taps import ModelTap
from workbench.probe import Probe

FP16_MAX = 65504.0
STASH_ROWS = 64          # a measured forward of at most this many rows is reduced once, at its end
HINT = ('store the KV cache as fp16 with a scale per page: EngineConfig(kv_cache_dtype="fp16_scaled"); '
        'or use bfloat16 (kv_cache_dtype="bfloat16" / dtype="bfloat16"), whose range reaches 3.4e38')
HIDDEN_HINT = ('run the activations in bfloat16 (EngineConfig(dtype="bfloat16")) or float32; '
               'fp16 cannot hold this layer\'s residual stream')



class _Tap(ModelTap):
    """What ModelHooks calls; each method already guarded by the probe (set on the instance: no
    extra call per layer). q feeds the score bound (computed in on_kv). forward_layers decides, once
    per forward, whether the hooks call it at all."""

    def __init__(self, on_kv, on_hidden, on_q=None, measuring=lambda: True, forward_layers=None):
        self.on_kv, self.on_hidden = on_kv, on_hidden
        if forward_layers is not None:     # every layer on a measured forward, none on the others
            self.forward_layers = forward_layers
        self._measuring = measuring
        self.needs = frozenset({"row_stats", "hidden_absmax", "every_row_hidden"} | ({"q"} if on_q is not None else set()))
        if on_q is not None:
            self.on_q = on_q

    def reads_every_row(self) -> bool:
        """Every row's last hidden state is read on measured forwards of at most STASH_ROWS rows
        only. On the others, and on big prefill forwards, the model runs its last layer for the
        sampled rows alone (keeping every row would add ~1/L of a prefill's linears); the layers
        before it see every row."""
        return self._measuring()


class FP16OverflowProbe(Probe):
    name = "fp16_overflow"
    description = "per layer / page absmax of K, V, hidden states and scores against fp16's 65504"

    def __init__(self, every: int = 4, warn_headroom: float = 0.5, scores: bool = True,
                 page_history: int = 64, max_history: int = 100_000, **params):
        super().__init__(every=every, warn_headroom=warn_headroom, scores=scores,
                         page_history=page_history, max_history=max_history, **params)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not isinstance(max_history, int) or max_history < 1:
            raise ValueError(f"max_history must be a positive int (frame() rows kept), got {max_history!r}")
        self.every, self.warn_headroom, self.scores = every, warn_headroom, scores
        self.max_history = max_history
        self.pages = deque(maxlen=page_history)   # (step, page ids, K max [L, P], V max [L, P])
        # One entry per measured step, its per-layer figures as arrays (frame() spreads them into one
        # row per layer): no 30 dicts a measured step, and bounded (a probe must not become the leak
        # it hunts: the rows grew without limit until stop 51).
        self._measured: list[tuple] = []
        self._measured_rows = 0
        self.measured_steps = 0
        self._first_step = None
        self._active = False
        self._h_in = None
        self._rows_t = self._batch = None
        self._k_norms = deque(maxlen=8)     # |k| per layer of recent measured steps: the keys decode reads

    # ---- lifecycle ---------------------------------------------------------------
    def on_attach(self, engine) -> None:
        m = engine.model
        self._L = engine.model_config.num_layers
        self._cache_kind(engine)
        self._act_fp16 = m.dtype == torch.float16
        self._score_scale = engine.attn.scale
        self._q, self._recompute = None, False
        self._tap = _Tap(self.guard(self._on_kv), self.guard(self._on_hidden), self.guard(self._on_q),
                         measuring=lambda: self._active and self._stash, forward_layers=self.guard(self._forward_layers))
        instrumentation.add_tap(engine, self._tap)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._active = False
        self._batch = self._rows_t = None

    def reset(self) -> None:
        super().reset()
        self.pages.clear()
        self._k_norms.clear()
        self._measured.clear()
        self._measured_rows = 0
        self.measured_steps = 0

    # ---- taps (inside Model.forward) -----------------------------------------------
    def _cache_kind(self, engine) -> None:
        # The headroom judged is that of the cache the kernels actually write (its tensors'
        # dtype and per-page scales), not the configured name: a backend or a re-page that
        # stores another dtype is judged by what it stores.
        cache = engine.kv.k[0] if engine.kv is not None and engine.kv.k else None
        scaled = cache is not None and kv_scale.page_scale(cache) is not None
        self._kv_dtype = cache.dtype if cache is not None else engine.kv_dtype
        self._kv_fp16 = self._kv_dtype == torch.float16 and not scaled
        self._kv_scaled = scaled

    def _forward_layers(self, batch):
        """Every layer on a measured forward, none on the others (an unmeasured step costs one call)."""
        self._begin(batch)
        return self._active

    def _begin(self, batch) -> None:
        step = self.engine.step_count
        if self._first_step is None:
            self._first_step = step
        self._active = (step - self._first_step) % self.every == 0
        if not self._active:
            return
        self._cache_kind(self.engine)
        L = self._L
        self._tk, self._tv, self._th = [None] * L, [None] * L, [None] * L
        self._qk = [None] * L
        self._rows_t, self._batch = None, batch          # _rows: made where read (not on a decode the store measured)
        # A decode-only forward's last tokens are all its rows: q is taken whole, no select per layer.
        self._all_rows = len(batch.seqs) == batch.input_ids.shape[0]
        # Few rows (decode): keep each layer's K, V, q rows and h (views the model no longer writes)
        # and reduce all layers in _finish with a handful of ops, not a handful per layer.
        self._stash = batch.input_ids.shape[0] <= STASH_ROWS
        self._h_in = None
        self._recompute = False

    @property
    def _rows(self) -> torch.Tensor:
        """The last token of each sequence of this forward (its rows in the packed batch)."""
        if self._rows_t is None:
            self._rows_t = self._batch.cu_seqlens_q[1:].long() - 1
        return self._rows_t

    def _on_q(self, layer, q) -> None:
        self._q = q                      # this layer's queries [T, Hq, D]; read in _on_kv right after

    def _on_kv(self, layer, k, v, batch) -> None:
        """A layer the fused store did not measure (the hooks call it nowhere else: "row_stats")."""
        if not self._active:
            self._q = None
            return
        if layer == 0:
            # q for the score bound: from the model's hook (on_q came right before), else
            # recomputed from each layer's input rows, which are then tracked through the layers
            self._recompute = self.scores and self._q is None
            if self._recompute:
                self._h_in = F.embedding(batch.input_ids.index_select(0, self._rows), self.engine.model.embed)
                self._h_of = -1
        if self._q is None and self._h_in is not None and self._h_of != layer - 1:
            self._h_in = None            # the previous layer's hidden state was not handed (its norm measured it)
        if self._stash:
            self._tk[layer], self._tv[layer] = k, v
        else:                            # K and V in one pass over q|k|v
            self._tk[layer], self._tv[layer] = self.engine.model_hooks.kv_absmax(layer, k, v)
        if self.scores and (self._q is not None or self._h_in is not None):
            m = self.engine.model
            if self._q is not None:      # the model's own q (RoPE rotates, so the norms are the same)
                q = self._q if self._all_rows else self._q.index_select(0, self._rows)
            else:                        # a model that does not hand q to its hooks: recompute it
                L = m.layers[layer]
                q = L.qkv(rms_norm(self._h_in, L.norm_attn, m.cfg.rms_norm_eps))[:, : m.q_size]
            self._q = None
            if self._stash:
                self._qk[layer] = q
            else:
                qn = q.float().reshape(q.shape[0], -1, m.cfg.head_dim).norm(dim=-1).amax()
                kn = k.float().norm(dim=-1).amax()
                self._qk[layer] = torch.stack([qn, kn])

    def _on_hidden(self, layer, h, batch) -> None:
        if not self._active:
            return
        if self._stash:
            self._th[layer] = h
        else:
            r = row_absmax(h)
            T = batch.input_ids.shape[0]
            if r.shape[0] != T:          # the last layer ran for the sampled rows only: the others read 0
                r = torch.zeros(T, dtype=r.dtype, device=r.device).index_copy_(0, batch.logits_indices, r)
            self._th[layer] = r
        if self._recompute and layer < self._L - 1:
            self._h_in, self._h_of = h.index_select(0, self._rows), layer
        if layer == self._L - 1:
            self._active = False
            self._finish(batch)
            self._batch = self._rows_t = None

    def _gather(self, batch):
        """K, V and hidden absmax [L, T] and the score bound's (max |q|, max |k|) per layer [L, 2] (None
        without scores), as numpy: what the fused store and the norms measured from their buffers (in one
        go), the rest from what on_kv / on_hidden kept (stashed tensors reduced in one call, or each
        layer's reduction)."""
        L, T = self._L, batch.input_ids.shape[0]
        hd = self.engine.model.cfg.head_dim
        hooks = self.engine.model_hooks
        KVH = np.zeros((3, L, T), np.float32)               # K, V, hidden: one array, reduced in one call
        K, V, H = KVH
        QK = np.full((L, 2), np.nan) if self.scores else None
        mine = [l for l in range(L) if self._tk[l] is not None]         # the layers on_kv saw
        # a buffer counts only where it holds this forward's T rows: a layer whose figures are in neither a
        # usable buffer nor what a tap kept is not judged from zeros
        buf, hb = hooks.stats_buffer(), hooks.hidden_buffer()
        measured = (buf is not None and buf.shape[2] == T and hooks.measured_layers()) or [False] * L
        theirs = [l for l in range(L) if self._tk[l] is None and measured[l]]    # the store measured them
        seen = [l for l in range(L) if self._th[l] is not None]         # the layers on_hidden saw
        normed = ([l for l in range(L - 1) if self._th[l] is None]      # the next layer's norm measured them
                  if hb is not None and hb.shape[1] == T else [])
        if len(mine) + len(theirs) < L or len(seen) + len(normed) < L:
            return None          # a layer neither measured nor handed (a failed call: its probe-error says so)
        if theirs:
            s = buf.numpy()                                              # [L, 4, T] (the CPU kernel's buffer)
            s = s if len(theirs) == L else s[theirs]
            K[theirs], V[theirs] = s[:, 0], s[:, 1]
            if QK is not None:
                qn = s[:, 3] if self._all_rows else s[:, 3][:, self._rows.cpu().numpy()]
                QK[theirs] = np.stack([qn.max(1), s[:, 2].max(1)], 1)   # NaN-propagating
        if normed:
            H[normed] = hb.numpy()[normed]
        if self._stash and all(self._th[l].shape[0] == T for l in seen):
            got = rows_absmax([self._tk[l] for l in mine] + [self._tv[l] for l in mine] + [self._th[l] for l in seen])
            got = np.asarray(got.float().cpu())                          # one call over the stashed tensors
            n = len(mine)
            K[mine], V[mine], H[seen] = got[:n], got[n:2 * n], got[2 * n:]
        else:                            # per-layer reductions (or stashed tensors not expected here): each now
            red = (lambda t: np.asarray(row_absmax(t).float().cpu())) if self._stash else \
                  (lambda t: np.asarray(t.float().cpu()))
            for l in mine:
                K[l], V[l] = red(self._tk[l]), red(self._tv[l])
            for l in seen:
                H[l] = red(self._th[l])
        have = [l for l in mine if self._qk[l] is not None]             # (no q, no bound: NaN)
        if QK is not None and have:
            if self._stash:              # q and k norms of the stashed layers, all at once
                q = torch.stack([self._qk[l].reshape(self._qk[l].shape[0], -1) for l in have]).float()
                qn = q.reshape(len(have), -1, hd).norm(dim=-1).amax(1)
                kn = torch.stack([self._tk[l].reshape(T, -1) for l in have]).float().reshape(len(have), -1, hd)
                QK[have] = np.asarray(torch.stack([qn, kn.norm(dim=-1).amax(1)], 1).cpu(), dtype=np.float64)
            else:
                QK[have] = np.asarray(torch.stack([self._qk[l] for l in have]).float().cpu(), dtype=np.float64)
        return KVH, QK

    # ---- one measured step ----------------------------------------------------------
    def _finish(self, batch) -> None:
        step = self.engine.step_count
        # [L, T] each, on the host once; the rest in numpy (a few small ops, not a dozen torch dispatches)
        got = self._gather(batch)
        if got is None:
            return
        KVH, qk = got
        K, V, H = KVH
        # each cold numpy call costs ~20-50 us here: the maxima in one call (NaN-propagating, as amax), the
        # non-finite counts only where a maximum says there are some (inf or NaN make the max so)
        stats = np.zeros((8 if self.scores else 6, self._L))
        stats[:3] = KVH.max(2)
        if not np.isfinite(stats[:3]).all():
            stats[3:6] = (~np.isfinite(KVH)).sum(2)
        if self.scores:
            stats[6:8] = qk.T
        kmax, vmax, hmax, knf, vnf, hnf = stats[:6]
        score = np.full(self._L, np.nan)
        if self.scores:
            self._k_norms.append(stats[7])
            score = self._score_scale * stats[6] * np.max(self._k_norms, axis=0)
        self.measured_steps += 1
        T = K.shape[1]
        with np.errstate(invalid="ignore"):
            headroom = np.fmax(np.fmax(kmax, vmax), hmax) / FP16_MAX
        self._measured.append((step, T, kmax, vmax, hmax, score, headroom, knf, vnf, hnf))
        self._measured_rows += self._L
        if self._measured_rows > self.max_history:      # the older half goes
            drop = len(self._measured) // 2
            self._measured_rows -= sum(len(m[2]) for m in self._measured[:drop])
            del self._measured[:drop]
        if self.pages.maxlen:
            self._record_pages(step, K, V, batch)
        self._judge(step, batch, (K, V, H), stats, score)

    def _record_pages(self, step, K, V, batch) -> None:
        """Per page written this step, K's and V's max over its rows ([L, pages] each; NaN spreads)."""
        page_of = np.asarray(batch.slot_mapping.cpu()).astype(np.int64) // batch.page_size
        order = np.argsort(page_of, kind="stable")
        sorted_pages = page_of[order]
        starts = np.flatnonzero(np.diff(sorted_pages, prepend=sorted_pages[:1] - 1))  # each page's first row
        kp = np.maximum.reduceat(K[:, order], starts, axis=1)      # [L, pages]: max over the page's rows
        vp = np.maximum.reduceat(V[:, order], starts, axis=1)
        self.pages.append((step, sorted_pages[starts], kp, vp))

    def _judge(self, step, batch, tensors, stats, score) -> None:
        kmax, vmax, hmax, knf, vnf, hnf = stats[:6]
        names = ("K", "V", "hidden")
        # inf/NaN: already broken, whatever the dtype. The first layer is where it starts.
        bad = np.nonzero(knf + vnf + hnf)[0]
        if len(bad):
            l = int(bad[0])
            which = next(i for i, c in enumerate((knf, vnf, hnf)) if c[l])
            n = int((knf, vnf, hnf)[which][l])
            self._report("error", "fp16-nonfinite", step, batch, l, tensors[which], which,
                         f"{n} token(s) of {names[which]} hold inf/NaN",
                         HINT if which < 2 or not self._act_fp16 else HIDDEN_HINT,
                         {"layers": bad.tolist(), "nonfinite_tokens": n})
        # K/V beyond fp16: severity by what the cache stores.
        with np.errstate(invalid="ignore"):
            kv = np.fmax(kmax, vmax)
            over = np.nonzero(kv > FP16_MAX)[0]
            near = np.nonzero((kv > self.warn_headroom * FP16_MAX) & (kv <= FP16_MAX))[0]
            h_over = np.nonzero(hmax > FP16_MAX)[0]
            h_near = np.nonzero((hmax > self.warn_headroom * FP16_MAX) & (hmax <= FP16_MAX))[0]
        if len(over):
            l = int(over[0])
            which = 0 if kmax[l] >= vmax[l] else 1
            if self._kv_fp16:
                sev, what = "error", ("exceeds fp16's 65504: the cast into the float16 KV cache makes it "
                                      "inf and attention over it returns NaN / garbage")
            elif self._kv_scaled:
                sev, what = "info", "exceeds fp16's 65504; the fp16_scaled cache's page scales absorb it"
            else:
                sev, what = "warn", ("exceeds fp16's 65504: fine in this cache's dtype, but an fp16 KV "
                                     "cache would store inf")
            self._report(sev, "fp16-kv-overflow", step, batch, l, tensors[which], which,
                         f"{names[which]} absmax {kv[l]:.4g} (headroom {kv[l] / FP16_MAX:.2f}) {what}",
                         HINT, {"layers": over.tolist(), "k_absmax": float(kmax[l]), "v_absmax": float(vmax[l])},
                         threshold=FP16_MAX)
        if len(near) and not self._kv_scaled:
            l = int(near[0])
            which = 0 if kmax[l] >= vmax[l] else 1
            self._report("warn" if self._kv_fp16 else "info", "fp16-headroom", step, batch, l, tensors[which],
                         which, f"{names[which]} absmax {kv[l]:.4g} uses {kv[l] / FP16_MAX:.0%} of fp16's range",
                         HINT, {"layers": near.tolist()}, threshold=self.warn_headroom * FP16_MAX)
        if len(h_over):
            l = int(h_over[0])
            sev = "error" if self._act_fp16 else "warn"
            what = ("overflows the fp16 activations" if self._act_fp16
                    else "would overflow if the model ran in fp16")
            self._report(sev, "fp16-hidden-overflow", step, batch, l, tensors[2], 2,
                         f"hidden absmax {hmax[l]:.4g} {what}", HIDDEN_HINT,
                         {"layers": h_over.tolist(), "hidden_absmax": float(hmax[l])}, threshold=FP16_MAX)
        elif len(h_near) and self._act_fp16:
            l = int(h_near[0])
            self._report("warn", "fp16-headroom", step, batch, l, tensors[2], 2,
                         f"hidden absmax {hmax[l]:.4g} uses {hmax[l] / FP16_MAX:.0%} of fp16's range",
                         HIDDEN_HINT, {"layers": h_near.tolist()}, threshold=self.warn_headroom * FP16_MAX)
        if self._act_fp16:
            with np.errstate(invalid="ignore"):
                s_over = np.nonzero(score > FP16_MAX)[0]
            if len(s_over):
                l = int(s_over[0])
                self.report("warn", f"layer {l}: attention scores may exceed fp16 (bound "
                            f"scale*|q|*|k| = {score[l]:.4g})", HINT, kind="fp16-score-risk",
                            dedup=("fp16-score-risk", l), step=step, layer=l,
                            evidence={"score_bound": float(score[l]), "layers": s_over.tolist()})

    def _report(self, severity, kind, step, batch, layer, tensor, which, what, hint, evidence,
                threshold=None) -> None:
        if (kind, layer) in self._seen:           # dedup before the (host-syncing) token lookup
            return
        row = np.asarray(tensor[layer])
        with np.errstate(invalid="ignore"):
            hit = ~np.isfinite(row) if threshold is None else ~(row <= threshold)
        tok = int(np.argmax(hit))
        i = int(np.searchsorted(batch.cu_seqlens_q_np, tok, side="right") - 1)
        seq = batch.seqs[i]
        page = int(batch.slot_mapping[tok]) // batch.page_size
        pos = int(batch.positions[tok])
        evidence = dict(evidence, tensor=("K", "V", "hidden")[which], token=tok, position=pos,
                        user_request_id=getattr(seq, "user_request_id", None))
        self.report(severity, f"layer {layer}: {what} (request {seq.request_id}, page {page}, position {pos})",
                    hint, kind=kind, dedup=(kind, layer), step=step, layer=layer, page=page,
                    request_id=seq.request_id, evidence=evidence)

    # ---- views -------------------------------------------------------------------------
    COLUMNS = ["step", "layer", "k_absmax", "v_absmax", "hidden_absmax", "score_bound", "headroom", "kv_headroom",
               "hidden_headroom", "k_nonfinite", "v_nonfinite", "hidden_nonfinite", "tokens"]

    def frame(self):
        """One row per (measured step, layer): K, V and hidden absmax, the score bound, their headroom
        (absmax / 65504) and non-finite counts, and the step's token count."""
        import pandas as pd
        if not self._measured:
            return pd.DataFrame(columns=self.COLUMNS)
        cols = list(zip(*self._measured))
        n = [len(k) for k in cols[2]]
        cat = lambda i: np.concatenate(cols[i])                      # noqa: E731
        kmax, vmax, hmax = cat(2), cat(3), cat(4)
        with np.errstate(invalid="ignore"):
            kv = np.fmax(kmax, vmax)
        return pd.DataFrame({
            "step": np.repeat(cols[0], n), "layer": np.concatenate([np.arange(k) for k in n]),
            "k_absmax": kmax, "v_absmax": vmax, "hidden_absmax": hmax, "score_bound": cat(5), "headroom": cat(6),
            "kv_headroom": kv / FP16_MAX, "hidden_headroom": hmax / FP16_MAX,
            "k_nonfinite": cat(7).astype(np.int64), "v_nonfinite": cat(8).astype(np.int64),
            "hidden_nonfinite": cat(9).astype(np.int64), "tokens": np.repeat(cols[1], n)}, columns=self.COLUMNS)

    def page_frame(self):
        """Per (measured step, layer, page written): K and V absmax and their headroom."""
        import pandas as pd
        out = []
        for step, pages, kp, vp in self.pages:
            L, P = kp.shape
            out.append(pd.DataFrame({"step": step, "layer": np.repeat(np.arange(L), P),
                                     "page": np.tile(pages, L), "k_absmax": kp.ravel(), "v_absmax": vp.ravel()}))
        if not out:
            return pd.DataFrame(columns=["step", "layer", "page", "k_absmax", "v_absmax", "headroom"])
        df = pd.concat(out, ignore_index=True)
        df["headroom"] = np.fmax(df["k_absmax"], df["v_absmax"]) / FP16_MAX
        return df

    def widget(self):
        """Heatmap: layer x measured step, colour = headroom (1.0 = fp16's limit)."""
        import plotly.express as px
        df = self.frame()
        if df.empty:
            return px.imshow([[0.0]], title=f"{self.name}: no data yet")
        grid = df.pivot_table(index="layer", columns="step", values="headroom", aggfunc="max")
        return px.imshow(grid, aspect="auto", origin="lower", color_continuous_scale="Inferno",
                         labels={"color": "absmax / 65504"}, title="fp16 headroom per layer and step")
