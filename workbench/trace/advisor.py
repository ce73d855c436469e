"""Pool advisor: sweep page sizes and pool sizes over a trace in simulate mode.

The seed write-ups' rule sizes the pool from production's P99 length, not the training
max_len: num_pages = ceil(max_batch x P99 length / page_size) x 1.3. The advisor
computes it and checks it against the simulation of the same trace.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os

import numpy as np

from ..engine.config import EngineConfig
from .replaying import replay
from .schema import Trace
from .simulate import StepCost
from .synth import scaled_length

log = logging.getLogger(__name__)


def rule_of_thumb_pages(lengths, max_batch: int, page_size: int, headroom: float = 1.3) -> int:
    """ceil(max_batch x P99(prompt + output) / page_size) x headroom."""
    p99 = float(np.percentile(np.asarray(lengths), 99))
    return int(math.ceil(math.ceil(max_batch * p99 / page_size) * headroom))


def advise(trace: Trace, page_sizes=(16, 32, 64, 128), pool_sizes=None, max_batch: int = 64,
           max_num_batched_tokens: int = 8192, length_scale: float = 1.0, limit: int | None = None,
           time_scale: float = 1.0, cost: StepCost | None = None, max_model_len: int | None = None,
           progress: bool = True, workers: int | None = None):
    """A DataFrame, one row per (page_size, num_pages): peak usage, internal waste, block-table
    bytes, preemptions, rejections, prefix hit rate; rows with recommended=True use the rule's size.

    The configurations are simulated in parallel processes, `workers` of them (default: one per
    core); workers=1, a single configuration, or processes that cannot start: one after another
    in this process. Same table either way."""
    import pandas as pd
    recs = trace.records[:limit] if limit else trace.records
    lengths = [scaled_length(r.prompt_len, length_scale) + max(1, scaled_length(r.output_len, length_scale))
               for r in recs]
    sub = Trace(list(recs), trace.source, trace.format)
    longest = max_model_len or max(lengths)
    combos = []
    for ps in page_sizes:
        rec_pages = max(rule_of_thumb_pages(lengths, max_batch, ps), math.ceil(max(lengths) / ps) + 1)
        sizes = sorted(set(pool_sizes or [max(2, rec_pages // 4), max(2, rec_pages // 2), rec_pages, rec_pages * 2])
                       | {rec_pages})
        combos += [(ps, n, n == rec_pages) for n in sizes]
    common = dict(max_batch=max_batch, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                  length_scale=length_scale, time_scale=time_scale, cost=cost, longest=longest)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(combos), desc="advisor", unit="config")
    workers = min(len(combos), workers or os.cpu_count() or 1)
    rows = None
    try:
        if workers > 1:
            rows = _sweep_parallel(sub, combos, common, workers, bar)
        if rows is None:
            rows = []
            for c in combos:
                rows.append(_simulate_config(sub, c, common))
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return pd.DataFrame(rows)


def _simulate_config(trace: Trace, combo: tuple, common: dict) -> dict:
    """One row of the advisor's table: the trace simulated on one (page size, pool size)."""
    ps, n, recommended = combo
    cfg = EngineConfig(page_size=ps, num_pages=n, max_num_seqs=common["max_batch"],
                       max_num_batched_tokens=common["max_num_batched_tokens"], max_model_len=common["max_model_len"])
    res = replay(trace, cfg, "simulate", length_scale=common["length_scale"], time_scale=common["time_scale"],
                 cost=common["cost"], progress=False, log=False)
    st, s = res.engine.stats(), res.steps
    mapped = s["pages_mapped"].replace(0, np.nan)
    return {
        "page_size": ps, "num_pages": n, "recommended": recommended,
        "kv_tokens": n * ps,
        "peak_usage": float(s["usage"].max()) if len(s) else 0.0,
        "mean_usage": float(s["usage"].mean()) if len(s) else 0.0,
        "internal_waste": float((s["waste_slots"] / (mapped * ps)).mean()) if len(s) else 0.0,
        "block_table_bytes": common["max_batch"] * math.ceil(common["longest"] / ps) * 4,
        "preemptions": st["num_preemptions"],
        "rejections": len(res.rejected),
        "prefix_hit_rate": st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]),
        "p99_ttft_s": float(res.requests["ttft_s"].quantile(0.99)) if len(res.requests) else float("nan"),
        "steps": len(s),
    }


_worker_trace: Trace | None = None


def _worker_init(trace: Trace) -> None:
    global _worker_trace
    _worker_trace = trace


def _worker_run(combo: tuple, common: dict) -> dict:
    return _simulate_config(_worker_trace, combo, common)


# Workers are forked from a fresh single-threaded server process that has imported the simulator
# (forkserver): they start in milliseconds and inherit none of this process's threads or locks (a
# notebook kernel, torch's thread pools); spawn where there is no forkserver.
_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _sweep_parallel(trace: Trace, combos: list, common: dict, workers: int, bar) -> list | None:
    """The rows in combos' order, simulated in `workers` processes; None when they cannot start."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    try:
        ctx = multiprocessing.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            ctx.set_forkserver_preload([__name__])       # the server imports the simulator once
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(trace,))
    except (OSError, ValueError, NotImplementedError) as e:
        log.warning("advisor: no worker processes (%s); simulating one configuration at a time", e)
        return None
    rows: list = [None] * len(combos)
    try:
        with ex:
            futures = {ex.submit(_worker_run, c, common): i for i, c in enumerate(combos)}
            for f in as_completed(futures):
                rows[futures[f]] = f.result()
                if bar is not None:
                    bar.update(1)
    except (BrokenProcessPool, OSError) as e:        # a worker could not start or died: do it here
        log.warning("advisor: worker processes failed (%s); simulating one configuration at a time", e)
        if bar is not None:
            bar.reset()
        return None
    return rows


def recommend(table) -> dict:
    """The smallest configuration with no rejection and no preemption; else the rule's row."""
    ok = table[(table["rejections"] == 0) & (table["preemptions"] == 0)]
    pick = (ok.sort_values(["kv_tokens", "internal_waste"]).iloc[0] if len(ok)
            else table[table["recommended"]].sort_values("preemptions").iloc[0])
    rule = table[table["recommended"] & (table["page_size"] == pick["page_size"])].iloc[0]
    return {"page_size": int(pick["page_size"]), "num_pages": int(pick["num_pages"]),
            "rule_num_pages": int(rule["num_pages"]), "rule_preemptions": int(rule["preemptions"]),
            "rule_rejections": int(rule["rejections"])}
