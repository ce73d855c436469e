"""The attention check inside vLLM's workers: one layer and one request row a step, what the
backend computed against float32 attention over that request's own stored K/V.

Seam: each checkable attention layer's `impl.forward` (an instance attribute set once the KV cache
exists: other layers, other processes and the hot path of unchecked layers pay one comparison).
vLLM's layer hands the backend q / k / v after RoPE and the output buffer there, and on the CPU and
FlashAttention backends the cache write (`unified_kv_cache_update`) has already run; impl.forward
is plain Python inside vLLM's opaque attention op, so torch.compile never traces it.

Per execution the plan picks a layer (execution e checks layer e % L of the checkable ones) and a
row of kind KINDS[(e + e // L) % 3] (decode, a chunk that reads earlier pages, a whole prompt), as
our engine's attention probe does. The reference is ours, not vLLM's: the rows of the request come
from the ledger (the scheduler's token counts in the worker's row order, not query_start_loc), its
K/V from the KV cache tensor through the blocks the ledger says it owns (mapped to kernel blocks as
vLLM maps them, unpacked as kv_layout.py learned from vLLM's own write), and the mask, window,
chunk (chunked-local attention), scale, soft-cap and GQA map from the layer's own attributes. Two
comparisons:

  write  the K/V this step handed to the layer vs what its slots hold now;
  read   the backend's output for up to `max_rows` query rows vs float32 attention over the stored
         K/V (true causal mask, sliding window or local chunk, scale, soft-cap, GQA map); when it
         fails, the nearest explanation (probes/attention_math.explain_read: mask shifted, scale, KV
         head map, page left out or read from its neighbour).

On CUDA / NPU nothing synchronizes the stream: the rows and pages are copied to pinned host memory
without blocking, an event is recorded, and the check is judged at a later execution once the
event has completed (never run on a GPU here: tested with a device double that counts every blocking
host read, tests/test_vllm_host_reads.py). Where the check cannot run (MLA,
an unknown backend's cache layout, ALiBi / sinks, KV sharing, an fp8 cache,
full CUDA graphs that replay attention without Python) the status line says so and why.
"""
from __future__ import annotations

import functools
import multiprocessing
import time

import numpy as np
import torch

from probes import attention_math as am

from . import sanitizer
from . import status as st
from .host_copy import record_event, to_host
from .kv_layout import layout_of, read_kv
from .worker_side import kernel_pages, kernel_stride

CHECK_ATTENTION = "vllm_attention"
KINDS = ("decode", "chunk", "prefill")
# by the cache's dtype; looser than our engine's fp32 / fp16 ones: vLLM's kernels accumulate in their own
# order and precision (AMX feeds bf16 probabilities into P @ V); clean runs stay under 4e-3 in bf16
PICTURE_HEADS = 6         # an attention-read finding pictures at most this many of its wrong heads
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
HINTS = {
    "attention-write": "the K/V stored at the request's slots are not the ones the layer handed to the cache "
                       "write: look at the backend's do_kv_cache_update / reshape_and_cache (head layout, slot "
                       "mapping) and the block ids the slots were computed from",
    "attention-read": "the pages hold the right K/V but the backend's attention over them is wrong: look at the "
                      "kernel's causal mask and sequence lengths, its scale, its query-head to KV-head map, the "
                      "block-table walk, the sliding window and soft-cap",
}


class AttentionWatch:
    def __init__(self, rep, settings, meta, max_rows: int = 8):
        self.rep, self.s, self.meta, self.max_rows = rep, settings, meta, max_rows
        self.layers: dict[str, dict] = {}          # checkable layer name -> what the check needs of it
        self.order: list[str] = []
        self.checks = 0
        self.check_s = 0.0
        self.max_err = {"write": 0.0, "read": 0.0}
        self.skipped: dict[str, int] = {}          # why a planned check did not run -> how often
        self._planned = None
        self._plan = None
        self._pending: list = []                   # device checks waiting for their copies
        self._unplanned = 0                        # executions in a row with a batch and no check planned
        self._cost_sent = time.monotonic()

    # ---- installing ---------------------------------------------------------------------------
    def on_runner_ready(self, runner) -> None:
        if not self.s.attention:
            self.rep.status(st.CheckStatus(CHECK_ATTENTION, False, reason="switched off (PAGEDKV_VLLM_ATTENTION=0)"))
            return
        cc = getattr(runner, "compilation_config", None)
        ctx = getattr(cc, "static_forward_context", None) or {}
        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
        left: dict[str, list[str]] = {}
        layouts = set()
        for name, layer in ctx.items():
            impl = getattr(layer, "impl", None)
            if impl is None or not hasattr(impl, "forward"):
                continue
            why, info = self._checkable(name, layer, impl, groups)
            if why:
                left.setdefault(why, []).append(name)
                continue
            self.layers[name] = info
            layouts.add(f"{type(impl).__name__} ({info['layout']} layout)")
            impl.forward = self._wrap(name, impl.forward)
        self.order = sorted(self.layers, key=lambda n: self.layers[n]["index"])
        mode = getattr(cc, "cudagraph_mode", None)
        eager = getattr(getattr(runner, "model_config", None), "enforce_eager", True)
        reasons = [f"{why}: {len(names)} layer(s), e.g. {names[0]}" for why, names in left.items()]
        if mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)() and not eager:
            reasons.append(f"cudagraph_mode {getattr(mode, 'name', mode)}: steps replayed as full CUDA graphs run "
                           "no Python and are not checked (--enforce-eager or a PIECEWISE mode checks every step)")
        path = f"{len(self.order)} of {len(self.order) + sum(map(len, left.values()))} attention layers, " \
               f"{', '.join(sorted(layouts)) or 'no backend it can read'}"
        self.rep.status(st.CheckStatus(CHECK_ATTENTION, bool(self.order), "AttentionImpl.forward (per layer)", path,
                                       "; ".join(reasons) if self.order or reasons else "no attention layer"))

    def _checkable(self, name, layer, impl, groups) -> tuple[str, dict]:
        if "MLA" in type(layer).__name__ or "MLA" in type(impl).__name__:
            return "MLA (latent K/V, another reference)", {}
        if str(getattr(impl, "attn_type", "decoder")).lower().split(".")[-1] != "decoder":
            return f"attention type {getattr(impl, 'attn_type', '?')}", {}
        if getattr(impl, "kv_sharing_target_layer_name", None):
            return "KV shared with another layer (nothing written)", {}
        if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
            return "ALiBi or attention sinks (not modelled)", {}
        g = next((i for i, gr in enumerate(groups) if name in gr.layer_names), None)
        if g is None:
            return "in no KV cache group", {}
        spec = type(groups[g].kv_cache_spec).__name__
        if spec not in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec"):
            return f"{spec} group (rows are not requests)", {}
        # chunked-local attention (Llama 4's RoPE layers): the layer's own chunk size, whichever group holds it
        # (its own ChunkedLocalAttentionSpec group, or a full one when the hybrid KV cache manager is off).
        # Its backend splits the batch into virtual rows; q / k / v / output stay in the scheduler's token order
        chunk = getattr(layer, "attention_chunk_size", None)
        if not chunk and spec == "ChunkedLocalAttentionSpec":
            chunk = groups[g].kv_cache_spec.attention_chunk_size
        chunk = int(chunk or 0)
        layout, why = layout_of(impl)
        if layout is None:
            return why, {}
        w = getattr(impl, "sliding_window", None)
        window = (w[0] + 1 if w[0] >= 0 else 0) if isinstance(w, tuple) else (w if w and w > 0 else 0)
        return "", {"index": _layer_index(name), "group": g, "layout": layout, "window": int(window), "chunk": chunk,
                    "softcap": float(getattr(impl, "logits_soft_cap", 0) or 0), "scale": float(impl.scale),
                    "heads": int(impl.num_heads), "head_size": int(impl.head_size),
                    "block_size": int(groups[g].kv_cache_spec.block_size)}

    def _wrap(self, name, orig):
        @functools.wraps(orig)
        def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, *a, **kw):
            plan = self._plan_for(name, attn_metadata)
            if plan is None:
                return orig(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            t0 = time.perf_counter()
            try:
                snap = self._take(plan, query, key, value)
            except Exception as e:
                self.rep.error("attention check (rows)", e)
                snap = None
            self.check_s += time.perf_counter() - t0
            out = orig(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            if snap is not None:
                t0 = time.perf_counter()
                try:
                    self._after(plan, snap, layer, kv_cache, output if output is not None else out)
                except Exception as e:
                    self.rep.error("attention check", e)
                self.check_s += time.perf_counter() - t0
            return out
        return forward

    # ---- which layer, which row -----------------------------------------------------------------
    def _plan_for(self, name, md):
        m = self.meta
        if md is None or m.runner is None or m.last_so is None:
            return None                             # a warm-up, profile or dummy run: no real batch
        if self._planned != m.executions:
            self._planned = m.executions
            t0 = time.perf_counter()
            self._judge_pending()
            try:
                self._plan = self._pick()
            except Exception as e:
                self.rep.error("attention check (plan)", e)
                self._plan = None
            self._unplanned = 0 if self._plan is not None else self._unplanned + 1
            if self._unplanned >= self.s.inactive_after:
                why = max(self.skipped, key=self.skipped.get) if self.skipped else "no plan"
                self.rep.inactive(CHECK_ATTENTION, CHECK_ATTENTION, self._unplanned,
                                  f"no attention layer checked for {self._unplanned} executions with a batch: {why}")
            self.check_s += time.perf_counter() - t0
            self._send_cost()
        p = self._plan
        return p if p is not None and p["layer"] == name else None

    def _skip(self, why: str):
        self.skipped[why] = self.skipped.get(why, 0) + 1
        return None

    def _pick(self):
        m = self.meta
        if not self.order:
            return None
        so = m.last_so
        if getattr(so, "scheduled_spec_decode_tokens", None):
            return self._skip("speculative decoding step (draft rows are not modelled)")
        req_ids = m.req_ids if m.req_ids is not None else list(m.runner.input_batch.req_ids)
        entries = [m.ledger.reqs.get(r) for r in req_ids]
        if not req_ids or any(e is None for e in entries):
            return self._skip("rows the ledger does not know")
        ns = np.array([e.scheduled for e in entries], dtype=np.int64)
        if int(ns.sum()) != int(getattr(so, "total_num_scheduled_tokens", ns.sum())):
            return self._skip("rows that are not the scheduler's batch (a micro-batch)")
        starts = np.concatenate([[0], np.cumsum(ns)[:-1]])
        f = m.executions - 1
        nl = len(self.order)
        name = self.order[f % nl]
        info = self.layers[name]
        kbs = info["block_size"]
        by_kind: dict[str, list[int]] = {k: [] for k in KINDS}
        for i, e in enumerate(entries):
            ctx = e.computed + e.scheduled
            pages = e.groups[info["group"]] if info["group"] < len(e.groups) else []
            if e.scheduled > 0 and len(pages) * kbs >= ctx:
                by_kind["decode" if e.scheduled == 1 else "chunk" if e.computed else "prefill"].append(i)
        want = (f + f // nl) % 3
        for j in range(3):
            kind = KINDS[(want + j) % 3]
            if by_kind[kind]:
                break
        else:
            return self._skip("no row whose pages the ledger covers")
        cand = by_kind[kind]
        i = max(cand, key=lambda c: entries[c].computed + entries[c].scheduled) if (f // 3) % 2 == 0 \
            else cand[(f // 6) % len(cand)]
        e = entries[i]
        return {"layer": name, "info": info, "request_id": req_ids[i], "row": int(starts[i]), "n": int(e.scheduled),
                "computed": int(e.computed), "kind": kind, "sel": am.sample_rows(int(e.scheduled), f, self.max_rows),
                "pages": list(e.groups[info["group"]]), "execution": m.executions}

    # ---- the check ------------------------------------------------------------------------------
    def _take(self, p, query, key, value):
        """This row's q (sampled rows) and the K/V it handed to the write (all its rows), before the backend
        runs: the output buffer and, for backends that write inside forward, the cache change under it."""
        a, b = p["row"], p["row"] + p["n"]
        sel = torch.from_numpy(p["sel"] + a).to(query.device)
        return {"q": _host(query.index_select(0, sel)), "k": _host(key[a:b]), "v": _host(value[a:b]), "sel": sel}

    def _after(self, p, snap, layer, kv_cache, output):
        info = p["info"]
        ctx = p["computed"] + p["n"]
        kbs = int(kv_cache.shape[2])
        bs = info["block_size"]
        pages = p["pages"]
        if kbs != bs:                               # the kernel's blocks: manager block b is b * stride + j
            ratio = bs // kbs
            pages = kernel_pages(pages, ratio, kernel_stride(
                self.meta.runner, ratio, lambda ag: p["layer"] in (getattr(ag, "layer_names", None) or ())))
        first = 0
        if info["window"]:                          # a window reads no key before p - W + 1: vLLM may have freed it
            first = max(0, p["computed"] - info["window"] + 1) // kbs
        elif info["chunk"]:                         # nor a chunk any key before its chunk's start (freed likewise)
            first = p["computed"] // info["chunk"] * info["chunk"] // kbs
        last = -(-ctx // kbs)
        blocks = pages[first:last]
        ks, vs = read_kv(info["layout"], kv_cache, blocks, isa=getattr(layer, "isa", None),
                         head_size=info["head_size"])
        o = output.view(output.shape[0], info["heads"], -1).index_select(0, snap["sel"])
        snap.update(ks=_host(ks), vs=_host(vs), o=_host(o), blocks=blocks, base=first * kbs, kbs=kbs,
                    dtype=kv_cache.dtype)
        if output.is_cuda or getattr(output.device, "type", "cpu") not in ("cpu",):
            snap["event"] = record_event(output.device)
            self._pending.append((p, snap))
            if len(self._pending) > 4:              # a device that never finishes: drop, never block
                del self._pending[0]
                self._skip("device copies not complete after 4 executions")
        else:
            self._judge(p, snap)

    def _judge_pending(self) -> None:
        while self._pending and (self._pending[0][1]["event"] is None or self._pending[0][1]["event"].query()):
            p, snap = self._pending.pop(0)
            try:
                self._judge(p, snap)
            except Exception as e:
                self.rep.error("attention check", e)

    @torch.no_grad()
    def _judge(self, p, s) -> None:
        info = p["info"]
        base, n, start = s["base"], p["n"], p["computed"]
        ks, vs = s["ks"].float(), s["vs"].float()
        ctx = start + n
        ks, vs = ks[: ctx - base], vs[: ctx - base]
        tol = TOLERANCE.get(s["dtype"], TOLERANCE[torch.bfloat16])
        kh, vh = s["k"].float(), s["v"].float()
        wk, wv = am.rel_rows(ks[start - base:], kh), am.rel_rows(vs[start - base:], vh)
        err_w = max(float(wk.max()), float(wv.max()))
        self.max_err["write"] = max(self.max_err["write"], err_w)
        self.checks += 1
        if err_w > tol:
            return self._report_write(p, s, wk, wv, ks[start - base:], vs[start - base:], kh, vh, tol)
        q, got = s["q"].float(), s["o"].float()
        pos = torch.from_numpy(p["sel"] + start)
        allowed = am.causal(pos, ctx - base, base, info["window"], chunk=info["chunk"])
        want = am.attend(q, ks, vs, allowed, info["scale"], softcap=info["softcap"])
        err = am.rel_rows(got, want)
        self.max_err["read"] = max(self.max_err["read"], float(err.max()))
        if float(err.max()) > tol:
            self._report_read(p, s, q, got, want, err, ks, vs, pos, tol)

    def _where(self, p, s, pos: int) -> tuple[int, dict]:
        i = (pos - s["base"]) // s["kbs"]
        page = int(s["blocks"][i]) if 0 <= i < len(s["blocks"]) else None
        return page, {"layer_name": p["layer"], "position": pos, "block": page, "block_index": pos // s["kbs"],
                      "offset": pos % s["kbs"], "row_kind": p["kind"], "query_start": p["computed"],
                      "context": p["computed"] + p["n"], "kv_cache_group": p["info"]["group"],
                      "layout": p["info"]["layout"]}

    def _emit(self, p, s, kind, pos, what, evidence) -> None:
        rid, layer = p["request_id"], p["info"]["index"]
        page, ev = self._where(p, s, pos)
        ev.update(evidence, layer=layer)
        msg = (f"execution {p['execution']}: request {rid}, layer {layer} ({p['layer']}), position {pos} "
               f"(block {page}, {p['kind']} row): {what}")
        f = sanitizer.finding(CHECK_ATTENTION, kind, "error", msg, p["execution"], rid, page, **ev)
        f["hint"] = HINTS[kind]
        self.rep.findings([f], key=lambda x: (x["kind"], x["request_id"], layer))

    def _report_write(self, p, s, wk, wv, ks, vs, kh, vh, tol) -> None:
        r = int(torch.nonzero((wk > tol) | (wv > tol))[0])
        bad_k = bool(wk[r] > tol)
        got, handed = (ks[r], kh[r]) if bad_k else (vs[r], vh[r])
        wrong = [int(h) for h in torch.nonzero(am.head_err(got[None], handed[None]) > tol).flatten()]
        norm = handed.abs().amax().clamp_min(1e-30)
        holds = {h: int(((got[h][None] - handed).abs().amax(-1) / norm).argmin()) for h in wrong}
        permuted = bool(wrong) and all(float((got[h] - handed[j]).abs().amax() / norm) <= tol and j != h
                                       for h, j in holds.items())
        explain = (f"heads stored in another order (stored head -> the head it holds: "
                   f"{', '.join(f'{h}->{j}' for h, j in holds.items())})" if permuted else
                   "not the values computed for this token")
        err = float(max(wk[r], wv[r]))
        self._emit(p, s, "attention-write", p["computed"] + r,
                   f"the {'K' if bad_k else 'V'} stored at its slot differs from what the layer handed to the cache "
                   f"write in KV head(s) {wrong} (error {err:.3g} x max, tolerance {tol:.1g}): {explain}",
                   {"check": "write", "tensor": "K" if bad_k else "V", "heads": wrong, "err": err, "tolerance": tol,
                    "rows_wrong": int(((wk > tol) | (wv > tol)).sum()),
                    **({"heads_hold": {str(h): j for h, j in holds.items()}} if permuted else {})})

    def _report_read(self, p, s, q, got, want, err, ks, vs, pos, tol) -> None:
        info = p["info"]
        r = int(torch.nonzero(err > tol)[0])
        heads = [int(h) for h in torch.nonzero(am.head_err(got, want) > tol).flatten()]
        match = am.explain_read(q, got, ks, vs, pos, info["scale"], tol, heads=heads, base=s["base"],
                                window=info["window"], softcap=info["softcap"], page_size=s["kbs"],
                                pages=s["blocks"], start=p["computed"], chunk=info["chunk"])
        # the finding's picture (probes/attention_picture.py draws it on the workbench's side): the
        # wrong heads' weights, want vs got, over the last keys up to the query; a few kB of JSON
        pic = am.picture(q, ks, r, int(pos[r]), info["scale"], base=s["base"], window=info["window"],
                         softcap=info["softcap"], explained=match[2] if match else None,
                         heads=(heads or list(range(q.shape[1])))[:PICTURE_HEADS], page_size=s["kbs"],
                         chunk=info["chunk"])
        self._emit(p, s, "attention-read", int(pos[r]),
                   f"the backend's attention output differs from float32 attention over the request's own stored "
                   f"K/V in head(s) {heads} (error {float(err[r]):.3g} x max, tolerance {tol:.1g}, "
                   f"{int((err > tol).sum())}/{len(err)} rows checked)"
                   + (f"; it matches {match[1]}" if match else "; no nearby explanation matches"),
                   {"check": "read", "heads": heads, "err": float(err[r]), "tolerance": tol,
                    "rows_wrong": int((err > tol).sum()), "rows": len(err), "picture": pic,
                    **({"explanation": match[0], "matches": match[1]} if match else {})})

    # ---- helpers ----------------------------------------------------------------------------------
    def _send_cost(self) -> None:
        now = time.monotonic()
        if now - self._cost_sent < 1.0 and self.checks % 16:
            return
        self._cost_sent = now
        self.rep.send(b"cost", {"check": CHECK_ATTENTION, "process": multiprocessing.current_process().name,
                                "checks": self.checks, "check_s": self.check_s, "executions": self.meta.executions,
                                "max_err": dict(self.max_err), "skipped": dict(self.skipped)})


def _layer_index(name: str) -> int:
    digits = [int(t) for t in name.split(".") if t.isdigit()]
    return digits[0] if digits else -1


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy that does not block the stream (host_copy.to_host: pinned, non_blocking) on a device.
    On CPU the tensor itself: a CPU check is judged inside the same impl.forward call, before vLLM reuses
    any buffer (q and the output rows are index_select copies already; the handed K/V slices are not
    written by the backend)."""
    return to_host(t)
