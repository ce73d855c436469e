"""Pool advisor: sweep page sizes and pool sizes over a trace in simulate mode.

The seed write-ups' rule sizes the pool from production's P99 length, not the training
max_len: num_pages = ceil(max_batch x P99 length / page_size) x 1.3. The advisor
computes it and checks it against the simulation of the same trace.
"""
from __future__ import annotations

import math

import numpy as np

from ..engine.config import EngineConfig
from .replay import replay
from .schema import Trace
from .simulate import StepCost
from .synth import scaled_length


def rule_of_thumb_pages(lengths, max_batch: int, page_size: int, headroom: float = 1.3) -> int:
    """ceil(max_batch x P99(prompt + output) / page_size) x headroom."""
    p99 = float(np.percentile(np.asarray(lengths), 99))
    return int(math.ceil(math.ceil(max_batch * p99 / page_size) * headroom))


def advise(trace: Trace, page_sizes=(16, 32, 64, 128), pool_sizes=None, max_batch: int = 64,
           max_num_batched_tokens: int = 8192, length_scale: float = 1.0, limit: int | None = None,
           time_scale: float = 1.0, cost: StepCost | None = None, max_model_len: int | None = None,
           progress: bool = True):
    """A DataFrame, one row per (page_size, num_pages): peak usage, internal waste, block-table
    bytes, preemptions, rejections, prefix hit rate; rows with recommended=True use the rule's size."""
    import pandas as pd
    recs = trace.records[:limit] if limit else trace.records
    lengths = [scaled_length(r.prompt_len, length_scale) + max(1, scaled_length(r.output_len, length_scale))
               for r in recs]
    sub = Trace(list(recs), trace.source, trace.format)
    longest = max_model_len or max(lengths)
    rows = []
    combos = []
    for ps in page_sizes:
        rec_pages = max(rule_of_thumb_pages(lengths, max_batch, ps), math.ceil(max(lengths) / ps) + 1)
        sizes = sorted(set(pool_sizes or [max(2, rec_pages // 4), max(2, rec_pages // 2), rec_pages, rec_pages * 2])
                       | {rec_pages})
        combos += [(ps, n, n == rec_pages) for n in sizes]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(combos), desc="advisor", unit="config")
    for ps, n, recommended in combos:
        cfg = EngineConfig(page_size=ps, num_pages=n, max_num_seqs=max_batch,
                           max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        res = replay(sub, cfg, "simulate", length_scale=length_scale, time_scale=time_scale, cost=cost,
                     progress=False, log=False)
        st, s = res.engine.stats(), res.steps
        mapped = s["pages_mapped"].replace(0, np.nan)
        rows.append({
            "page_size": ps, "num_pages": n, "recommended": recommended,
            "kv_tokens": n * ps,
            "peak_usage": float(s["usage"].max()) if len(s) else 0.0,
            "mean_usage": float(s["usage"].mean()) if len(s) else 0.0,
            "internal_waste": float((s["waste_slots"] / (mapped * ps)).mean()) if len(s) else 0.0,
            "block_table_bytes": max_batch * math.ceil(longest / ps) * 4,
            "preemptions": st["num_preemptions"],
            "rejections": len(res.rejected),
            "prefix_hit_rate": st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]),
            "p99_ttft_s": float(res.requests["ttft_s"].quantile(0.99)) if len(res.requests) else float("nan"),
            "steps": len(s),
        })
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return pd.DataFrame(rows)


def recommend(table) -> dict:
    """The smallest configuration with no rejection and no preemption; else the rule's row."""
    ok = table[(table["rejections"] == 0) & (table["preemptions"] == 0)]
    pick = (ok.sort_values(["kv_tokens", "internal_waste"]).iloc[0] if len(ok)
            else table[table["recommended"]].sort_values("preemptions").iloc[0])
    rule = table[table["recommended"] & (table["page_size"] == pick["page_size"])].iloc[0]
    return {"page_size": int(pick["page_size"]), "num_pages": int(pick["num_pages"]),
            "rule_num_pages": int(rule["num_pages"]), "rule_preemptions": int(rule["preemptions"]),
            "rule_rejections": int(rule["rejections"])}
