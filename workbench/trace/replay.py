"""Replay a trace through an engine: arrivals on a deterministic virtual clock.

The clock advances by a step-cost model (seconds = per_step + per_token x tokens), not
by wall time, so the same trace and seed give the same event stream on any machine;
a request arrives once the clock passes its (scaled) arrival time, and an idle engine
jumps to the next arrival. Wall time is measured alongside.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.sequence import SamplingParams
from .schema import Trace
from .synth import prompt_tokens, scaled_length


@dataclass
class StepCost:
    per_step_s: float = 0.004
    per_token_s: float = 0.0002

    def __call__(self, num_tokens: int) -> float:
        return self.per_step_s + self.per_token_s * num_tokens


@dataclass
class ReplayResult:
    requests: object                      # DataFrame: one row per request
    steps: object                         # DataFrame: one row per step (pool timeline)
    log: object = None                    # EventLog
    findings: object = None               # DataFrame
    rejected: list = field(default_factory=list)
    wall_s: float = 0.0


def replay_full(trace: Trace, engine, *, time_scale: float = 1.0, length_scale: float = 1.0,
                output_scale: float | None = None, max_prompt_len: int | None = None,
                max_output_len: int | None = None, limit: int | None = None, seed: int = 0,
                cost: StepCost | None = None, workbench=None, progress: bool = False) -> ReplayResult:
    import pandas as pd
    from ..events import EventLog
    cost = cost or StepCost()
    records = trace.records[:limit] if limit else trace.records
    vocab = engine.model_config.vocab_size
    out_scale = length_scale if output_scale is None else output_scale
    max_plen = max_prompt_len or engine.max_model_len - 1
    log = workbench.log if workbench is not None and workbench.log is not None else EventLog(engine.bus)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(records), desc="replay", unit="req")
    clock, nxt, t0 = 0.0, 0, time.perf_counter()
    rid_of, arrival_of, first_tok, finish, rejected, steps = {}, {}, {}, {}, [], []
    while nxt < len(records) or engine.has_unfinished():
        if not engine.has_unfinished() and nxt < len(records):
            clock = max(clock, records[nxt].arrival_s * time_scale)
        while nxt < len(records) and records[nxt].arrival_s * time_scale <= clock:
            r = records[nxt]
            ids = prompt_tokens(r, nxt, vocab, seed, length_scale, max_plen)
            n_out = max(1, scaled_length(r.output_len, out_scale))
            if max_output_len:
                n_out = min(n_out, max_output_len)
            try:
                rid = engine.add_request(ids, SamplingParams(max_tokens=n_out, ignore_eos=True), request_id=r.id)
                rid_of[rid] = r.id
                arrival_of[rid] = clock
            except ValueError as e:
                rejected.append((r.id, str(e)))
                if bar is not None:
                    bar.update(1)
            nxt += 1
        outs = engine.step()
        batch = engine.last_batch
        clock += cost(batch.num_tokens if batch is not None else 0)
        st = engine.stats()
        steps.append({"step": engine.step_count, "clock_s": clock, "pages_used": st["pages_used"],
                      "pages_cached": st["pages_cached"], "num_running": st["num_running"],
                      "num_waiting": st["num_waiting"], "num_preemptions": st["num_preemptions"],
                      "usage": st["kv_cache_usage"]})
        for o in outs:
            if o.request_id not in first_tok and o.token_ids:
                first_tok[o.request_id] = clock
            if o.finished:
                finish[o.request_id] = (clock, o)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    rows = []
    for rid, (t_end, o) in finish.items():
        n = len(o.token_ids)
        ttft = first_tok.get(rid, t_end) - arrival_of[rid]
        rows.append({"request_id": rid, "trace_id": rid_of[rid], "arrival_s": arrival_of[rid],
                     "prompt_len": len(o.prompt_token_ids), "output_len": n, "ttft_s": ttft,
                     "tpot_s": (t_end - first_tok.get(rid, t_end)) / max(1, n - 1),
                     "num_preemptions": o.num_preemptions, "num_cached_tokens": o.num_cached_tokens,
                     "finish_reason": o.finish_reason})
    findings = workbench.findings if workbench is not None else None
    return ReplayResult(pd.DataFrame(rows), pd.DataFrame(steps), log, findings, rejected,
                        time.perf_counter() - t0)
