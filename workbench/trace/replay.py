"""Replay a trace: through the real model (full) or the real scheduler and pool (simulate).

Arrivals run on a deterministic virtual clock: it advances by a step-cost model
(seconds = per_step + per_token x tokens), not by wall time, so the same trace and
seed give the same event stream on any machine. A request arrives once the clock
passes its (scaled) arrival time; an idle engine jumps to the next arrival.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from ..engine.sequence import SamplingParams
from .schema import Trace
from .simulate import Simulator, StepCost
from .synth import prompt_tokens, scaled_length

MODES = ("full", "simulate")


@dataclass
class ReplayResult:
    requests: object                      # DataFrame: one row per finished request (TTFT, TPOT, preemptions)
    steps: object                         # DataFrame: one row per step, the pool timeline
    log: object = None                    # EventLog of every event
    findings: object = None               # DataFrame of the probes' findings (with a workbench)
    rejected: list = field(default_factory=list)     # (trace id, reason)
    wall_s: float = 0.0
    mode: str = "full"
    engine: object = None

    def event_hash(self) -> str:
        """A digest of the event stream without wall-clock fields: equal for equal replays."""
        h = hashlib.sha256()
        df = self.log.frame()
        drop = [c for c in df.columns if c.endswith("_ns") or c.endswith("_s")]   # wall-clock readings
        h.update(df.drop(columns=drop).to_csv(index=False).encode())
        return h.hexdigest()


def _full_driver(engine, vocab, seed, length_scale, max_plen):
    def add(r, i, n_out):
        ids = prompt_tokens(r, i, vocab, seed, length_scale, max_plen)
        return engine.add_request(ids, SamplingParams(max_tokens=n_out, ignore_eos=True), request_id=r.id)

    def step():
        outs = engine.step()
        b = engine.last_batch
        n = b.num_tokens if b is not None else 0
        return n, [(o.request_id, len(o.token_ids), o.finished, o.num_preemptions, o.num_cached_tokens,
                    len(o.prompt_token_ids)) for o in outs]
    return add, step


def _sim_driver(sim: Simulator, length_scale, max_plen):
    def add(r, i, n_out):
        plen = scaled_length(r.prompt_len, length_scale)
        block = scaled_length(r.hash_block_size, length_scale) if r.hash_ids else None
        if max_plen:
            plen = min(plen, max_plen)
        return sim.add_request(plen, n_out, r.hash_ids, block, request_id=r.id)

    def step():
        seqs = sim.step()
        return sim.last_num_tokens, [(s.request_id, s.num_output, s.is_finished, s.num_preemptions,
                                      s.num_cached_tokens, s.prompt_len) for s in seqs]
    return add, step


def replay(trace: Trace, target=None, mode: str = "full", *, time_scale: float = 1.0,
           length_scale: float = 1.0, output_scale: float | None = None, max_prompt_len: int | None = None,
           max_output_len: int | None = None, limit: int | None = None, seed: int = 0,
           cost: StepCost | None = None, workbench=None, progress: bool = True, log: bool = True) -> ReplayResult:
    """Replay trace through target: an Engine, a Workbench, or an EngineConfig (full: the default
    model is loaded; simulate: only the pool and scheduler are built)."""
    import pandas as pd
    from ..engine import Engine, EngineConfig
    from ..events import EventLog
    from ..workbench import Workbench
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {MODES}")
    if isinstance(target, Workbench):
        workbench, target = target, target.engine
    cost = cost or StepCost()
    if mode == "simulate":
        if isinstance(target, Engine):
            target = target.config
        sim = Simulator(target if isinstance(target, EngineConfig) else EngineConfig(num_pages=65536), cost)
        engine = sim
        add, step = _sim_driver(sim, length_scale, max_prompt_len)
    else:
        engine = target if isinstance(target, Engine) else Engine.from_default(target)
        add, step = _full_driver(engine, engine.model_config.vocab_size, seed, length_scale,
                                 max_prompt_len or engine.max_model_len - 1)
    records = trace.records[:limit] if limit else trace.records
    out_scale = length_scale if output_scale is None else output_scale
    ev_log = None
    if workbench is not None and workbench.log is not None:
        ev_log = workbench.log
    elif log:
        ev_log = EventLog(engine.bus, max_rows=None)      # a replay's past is kept whole (time travel needs it)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(records), desc=f"replay ({mode})", unit="req")
    clock, nxt, t0 = 0.0, 0, time.perf_counter()
    meta, first_tok, rows, rejected, steps = {}, {}, [], [], []
    while nxt < len(records) or engine.has_unfinished():
        if not engine.has_unfinished() and nxt < len(records):
            clock = max(clock, records[nxt].arrival_s * time_scale)
        while nxt < len(records) and records[nxt].arrival_s * time_scale <= clock:
            r = records[nxt]
            n_out = max(1, scaled_length(r.output_len, out_scale))
            if max_output_len:
                n_out = min(n_out, max_output_len)
            try:
                meta[add(r, nxt, n_out)] = (r.id, clock)
            except ValueError as e:
                rejected.append((r.id, str(e)))
                if bar is not None:
                    bar.update(1)
            nxt += 1
        if mode == "simulate":
            engine.clock = clock
        n_tok, produced = step()
        clock += cost(n_tok) if n_tok else 0.0
        st = engine.stats()
        ps = engine.config.page_size
        running = engine.scheduler.running
        steps.append({"step": st["steps"], "clock_s": clock, "num_tokens": n_tok, "pages_used": st["pages_used"],
                      "waste_slots": sum(-s.num_computed_tokens % ps for s in running),
                      "pages_mapped": sum(len(s.pages) for s in running),
                      "pages_cached": st["pages_cached"], "num_running": st["num_running"],
                      "num_waiting": st["num_waiting"], "num_preemptions": st["num_preemptions"],
                      "usage": st["kv_cache_usage"]})
        for rid, n, finished, preempt, cached, plen in produced:
            first_tok.setdefault(rid, clock)
            if finished:
                tid, arr = meta[rid]
                f = first_tok[rid]
                rows.append({"request_id": rid, "trace_id": tid, "arrival_s": arr, "prompt_len": plen,
                             "output_len": n, "ttft_s": f - arr, "tpot_s": (clock - f) / max(1, n - 1),
                             "latency_s": clock - arr, "num_preemptions": preempt, "num_cached_tokens": cached})
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    findings = workbench.findings if workbench is not None else None
    return ReplayResult(pd.DataFrame(rows), pd.DataFrame(steps), ev_log, findings, rejected,
                        time.perf_counter() - t0, mode, engine)


def replay_full(trace: Trace, engine, **kw) -> ReplayResult:
    kw.setdefault("progress", False)
    return replay(trace, engine, "full", **kw)
