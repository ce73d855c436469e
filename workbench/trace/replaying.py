"""Replay a trace: through the real model (full) or the real scheduler and pool (simulate).

Arrivals run on a deterministic virtual clock: it advances by a step-cost model
(seconds = per_step + per_token x tokens), not by wall time, so the same trace and
seed give the same event stream on any machine. A request arrives once the clock
passes its (scaled) arrival time; an idle engine jumps to the next arrival.
"""
from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import dataclass, field

from ..engine import seq_ops
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
        drop = [c for c in df.columns if c.endswith(("_ns", "_s", "_time"))]   # wall-clock readings
        h.update(df.drop(columns=drop).to_csv(index=False).encode())
        return h.hexdigest()


STEP_COLUMNS = ["step", "clock_s", "num_tokens", "pages_used", "waste_slots", "pages_mapped", "pages_cached",
                "num_running", "num_waiting", "num_preemptions", "usage"]


def _full_driver(engine, vocab, seed, length_scale, max_plen, cost):
    """add(record, index, n_out) -> request id; step(clock) -> (tokens, clock after, finished, step row)."""
    first_tok: dict = {}

    def add(r, i, n_out):
        ids = prompt_tokens(r, i, vocab, seed, length_scale, max_plen)
        return engine.add_request(ids, SamplingParams(max_tokens=n_out, ignore_eos=True), request_id=r.id)

    def step(clock):
        outs = engine.step()
        b = engine.last_batch
        n = b.num_tokens if b is not None else 0
        clock += cost(n) if n else 0.0
        done = []
        for o in outs:
            first_tok.setdefault(o.request_id, clock)
            if o.finished:
                done.append((o.request_id, len(o.token_ids), o.num_preemptions, o.num_cached_tokens,
                             len(o.prompt_token_ids), first_tok[o.request_id]))
        st = engine.stats()
        waste, n_mapped = seq_ops.active().mapped(engine.scheduler.running, engine.config.page_size)  # a fault may re-page
        row = (st["steps"], clock, n, st["pages_used"], waste, n_mapped, st["pages_cached"], st["num_running"],
               st["num_waiting"], st["num_preemptions"], st["kv_cache_usage"])
        return n, clock, done, row
    return add, step


def _sim_driver(sim: Simulator, length_scale, max_plen):
    pool, sched, ps = sim.pool, sim.scheduler, sim.config.page_size
    mapped = seq_ops.active().mapped

    def add(r, i, n_out):
        plen = scaled_length(r.prompt_len, length_scale)
        block = scaled_length(r.hash_block_size, length_scale) if r.hash_ids else None
        if max_plen:
            plen = min(plen, max_plen)
        return sim.add_request(plen, n_out, r.hash_ids, block, request_id=r.id)

    def step(clock):
        sim.clock = clock
        sim.step()
        n, clock = sim.last_num_tokens, sim.clock         # the simulator's clock ran by the same cost
        done = [(s.request_id, s.num_output, s.num_preemptions, s.num_cached_tokens, s.prompt_len,
                 s.first_token_time) for s in sim.last_finished]
        waste, n_mapped = mapped(sched.running, ps)
        used = pool.num_pages - pool.num_free
        row = (sim.step_count, clock, n, used, waste, n_mapped, pool.num_cached_free, len(sched.running),
               len(sched.waiting), sched.num_preemptions, used / pool.num_pages)
        return n, clock, done, row
    return add, step


def replay(trace: Trace, target=None, mode: str = "full", *, time_scale: float = 1.0,
           length_scale: float = 1.0, output_scale: float | None = None, max_prompt_len: int | None = None,
           max_output_len: int | None = None, limit: int | None = None, seed: int = 0,
           cost: StepCost | None = None, workbench=None, progress: bool = True, log: bool = True) -> ReplayResult:
    """Replay trace through target: an Engine, a Workbench, or an EngineConfig (full: the default
    model is loaded; simulate: only the pool and scheduler are built)."""
    import pandas as pd
    from ..engine import Engine, EngineConfig
    from ..event_log import EventLog
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {MODES}")
    if not isinstance(target, (Engine, EngineConfig)) and isinstance(getattr(target, "engine", None), Engine):
        workbench, target = target, target.engine         # a Workbench (above this module: not imported)
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
                                 max_prompt_len or engine.max_model_len - 1, cost)
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
    t0 = time.perf_counter()
    meta, rows, rejected, steps = {}, [], [], []
    # A simulated replay allocates millions of small long-lived objects (hash chains, the log's
    # rows) and frees them by reference counting, making no cycles; the cyclic collector would
    # rescan them all again and again (~20% of the run). It is paused for the run; what the run
    # left alive is then frozen (gc.freeze: kept out of later scans, still freed by refcount)
    # so that the first collection after it does not walk them all either.
    gc_was_on = gc.isenabled()
    if mode == "simulate":
        gc.disable()
    try:
        _run(records, add, step, engine.has_unfinished, meta, rows, rejected, steps, bar, time_scale, out_scale,
             max_output_len)
    finally:
        if mode == "simulate":
            gc.freeze()
        if gc_was_on:
            gc.enable()
    if bar is not None:
        bar.close()
    findings = workbench.findings if workbench is not None else None
    return ReplayResult(pd.DataFrame(rows), pd.DataFrame.from_records(steps, columns=STEP_COLUMNS), ev_log,
                        findings, rejected, time.perf_counter() - t0, mode, engine)


def _run(records, add, step, has_unfinished, meta, rows, rejected, steps, bar, time_scale, out_scale,
         max_output_len):
    """The arrival / step loop: adds requests as the virtual clock passes them, steps, collects rows."""
    clock, nxt = 0.0, 0
    while nxt < len(records) or has_unfinished():
        if nxt < len(records):
            if not has_unfinished():
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
        _, clock, done, row = step(clock)
        steps.append(row)
        for rid, n, preempt, cached, plen, f in done:
            tid, arr = meta[rid]
            rows.append({"request_id": rid, "trace_id": tid, "arrival_s": arr, "prompt_len": plen,
                         "output_len": n, "ttft_s": f - arr, "tpot_s": (clock - f) / max(1, n - 1),
                         "latency_s": clock - arr, "num_preemptions": preempt, "num_cached_tokens": cached})
        if bar is not None and done:
            bar.update(len(done))


def replay_full(trace: Trace, engine, **kw) -> ReplayResult:
    kw.setdefault("progress", False)
    return replay(trace, engine, "full", **kw)
