"""PoolProbe: how full the KV page pool is, what it wastes, what sharing saves, and preemptions.

Per step (every `every` steps): used / total pages (the ratio operators alert on at
0.95, field note 13), internal waste (empty slots in each live sequence's last page),
prefix-sharing savings (pages mapped by more than one sequence, counted once), pages
used but mapped by no live sequence, preemptions, and the counterfactual: what a
contiguous allocator would have reserved for the same live requests, at max_model_len
each and at prompt + max_tokens each (field note: 74% of such a reservation unused).

Findings: usage above the alert (error, with the sizing rule of field note 10 as the
hint), a preemption storm (warn), pages held outside any live sequence (warn).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from workbench.events import RequestFinished, RequestPreempted, StepFinished
from workbench.probe import Probe


def advise_pool_size(lengths, max_batch: int, page_size: int, headroom: float = 1.3,
                     quantile: float = 0.99) -> int:
    """Pages for a pool that serves max_batch requests at the P99 length without preempting:
    ceil(batch x P99 length / page_size) x 1.3 (field note 10: size from production's P99,
    not the training max_len)."""
    lengths = np.asarray(list(lengths), dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("advise_pool_size needs at least one request length")
    if max_batch < 1 or page_size < 1:
        raise ValueError(f"max_batch and page_size must be >= 1, got {max_batch}, {page_size}")
    p99 = float(np.quantile(lengths, quantile))
    pages = math.ceil(max_batch * p99 / page_size - 1e-9)
    return math.ceil(pages * headroom - 1e-9)            # 50 x 1.3 is 65.00000000000001


class PoolProbe(Probe):
    name = "pool"
    description = "KV pool usage, internal waste, prefix-sharing savings, preemptions, contiguous counterfactual"

    def __init__(self, every: int = 1, usage_alert: float = 0.95, sustain: int = 3, storm_window: int = 16,
                 storm_threshold: int = 4, max_rows: int = 100_000, max_lengths: int = 100_000, **params):
        """usage_alert for `sustain` consecutive steps is an error; storm_threshold preemptions
        within storm_window steps is a storm."""
        super().__init__(every=every, usage_alert=usage_alert, sustain=sustain, storm_window=storm_window,
                         storm_threshold=storm_threshold, max_rows=max_rows, max_lengths=max_lengths, **params)
        self.max_rows = max_rows
        self.every = max(1, every)
        self.usage_alert = usage_alert
        self.sustain = sustain
        self.storm_window = storm_window
        self.storm_threshold = storm_threshold
        self._preempted: list[int] = []              # request ids preempted since the last step
        self._storm: deque = deque()                 # (step, request ids) within the window
        self._high = 0                               # consecutive steps above usage_alert
        self._live_lengths: dict = {}                # running request id -> length it may reach
        self._lengths: deque = deque(maxlen=max_lengths)   # lengths finished requests reached
        self._peak_demand = 0                        # most requests running + waiting at once
        self.total_preemptions = 0

    def on_attach(self, engine) -> None:
        self.listen(RequestPreempted, lambda e: self._preempted.append(e.request_id))
        self.listen(RequestFinished, self.on_finished)
        self.listen(StepFinished, self.on_step)

    def on_finished(self, e: RequestFinished) -> None:
        self._live_lengths.pop(e.request_id, None)
        if e.reason != "abort":
            self._lengths.append(e.prompt_len + e.output_len)

    # ---- per step ----------------------------------------------------------------
    def on_step(self, e: StepFinished) -> None:
        eng = self.engine
        pool = eng.pool
        used, total = pool.num_used, pool.num_pages
        usage = used / total
        preempted, self._preempted = self._preempted, []
        self.total_preemptions += len(preempted)
        running = eng.scheduler.running
        self._peak_demand = max(self._peak_demand, len(running) + len(eng.scheduler.waiting))
        for s in running:
            self._live_lengths.setdefault(s.request_id, s.max_len)
        self._check_storm(e.step, preempted)
        self._check_usage(e.step, used, total, usage)
        if e.step % self.every == 0:
            self.rows.append(self._row(e.step, used, total, usage, len(preempted), running))
            if len(self.rows) > self.max_rows:          # a probe must not become a leak
                del self.rows[: len(self.rows) // 2]

    def _row(self, step: int, used: int, total: int, usage: float, preempted: int, running) -> dict:
        eng, pool = self.engine, self.engine.pool
        ps = pool.page_size
        mapped = sum(len(s.pages) for s in running)
        distinct = len(set().union(*(s.pages for s in running))) if running else 0
        tokens = sum(min(s.num_computed_tokens, len(s.pages) * ps) for s in running)
        waste = sum(len(s.pages) * ps - min(s.num_computed_tokens, len(s.pages) * ps) for s in running)
        per_max = -(-eng.max_model_len // ps)
        contig_max = len(running) * per_max
        contig_req = sum(-(-s.max_len // ps) for s in running)
        unmapped = used - distinct
        if unmapped > 0:
            self.report("warn", f"{unmapped} of {used} used pages are mapped by no live sequence",
                        hint="pages taken outside the scheduler and not given back (a leaked reservation, "
                             "or a release that was skipped); they shrink the usable pool",
                        kind="pool-unmapped-pages", step=step, dedup="pool-unmapped-pages",
                        evidence={"unmapped_pages": unmapped, "pages_used": used})
        return {
            "step": step, "pages_total": total, "pages_used": used, "usage": usage,
            "pages_free": pool.num_free, "pages_cached": pool.num_cached_free,
            "live_seqs": len(running), "waiting": len(eng.scheduler.waiting), "live_tokens": tokens,
            "waste_slots": waste, "waste_share": waste / (distinct * ps) if distinct else 0.0,
            "shared_saved_pages": mapped - distinct, "unmapped_pages": unmapped, "preemptions": preempted,
            "contiguous_max_len_pages": contig_max, "contiguous_request_pages": contig_req,
            "paged_vs_max_len": (distinct / contig_max) if contig_max else math.nan,
        }

    # ---- findings -------------------------------------------------------------------
    def sizing(self) -> dict:
        """The sizing rule applied to what this probe has seen."""
        eng = self.engine
        ps = eng.pool.page_size
        # finished, running and still-waiting requests: early in a run most demand is still queued
        waiting = [s.max_len for s in list(eng.scheduler.waiting) if s.request_id not in self._live_lengths]
        lengths = list(self._lengths) + list(self._live_lengths.values()) + waiting or [eng.max_model_len]
        batch = max(1, min(self._peak_demand, eng.config.max_num_seqs))
        pages = advise_pool_size(lengths, batch, ps)
        p99 = float(np.quantile(np.asarray(lengths, dtype=np.float64), 0.99))
        running = eng.scheduler.running
        mapped = len(set().union(*(s.pages for s in running))) if running else 0
        held_outside = eng.pool.num_used - mapped            # pages no live request can use
        return {"pages": pages, "batch": batch, "p99_length": p99, "page_size": ps,
                "bytes": pages * eng.kv.bytes_per_page, "usable_pages": eng.pool.num_pages - held_outside}

    def _hint(self) -> str:
        z = self.sizing()
        return (f"size the pool from production lengths, not max_len: ceil(batch {z['batch']} x P99 length "
                f"{z['p99_length']:.0f} / page_size {z['page_size']}) x 1.3 = {z['pages']} pages "
                f"({z['bytes'] / 2**20:.1f} MiB): EngineConfig(num_pages={z['pages']}); now "
                f"{self.engine.pool.num_pages} pages, {z['usable_pages']} of them usable by requests")

    def _check_usage(self, step: int, used: int, total: int, usage: float) -> None:
        self._high = self._high + 1 if usage > self.usage_alert else 0
        if self._high == self.sustain:
            self.report("error", f"KV pool at {usage:.0%} ({used}/{total} pages) for {self.sustain} steps, "
                                 f"above the {self.usage_alert:.0%} alert; {self.total_preemptions} preemptions "
                                 f"so far",
                        hint=self._hint(), kind="pool-usage", step=step, dedup=("pool-usage", step // 1000),
                        evidence={"usage": usage, "pages_used": used, "pages_total": total,
                                  "preemptions": self.total_preemptions, **self.sizing()})

    def _check_storm(self, step: int, preempted: list[int]) -> None:
        if preempted:
            self._storm.append((step, preempted))
        while self._storm and self._storm[0][0] <= step - self.storm_window:
            self._storm.popleft()
        n = sum(len(p) for _, p in self._storm)
        if n >= self.storm_threshold:
            victims = sorted({r for _, p in self._storm for r in p})
            self.report("warn", f"preemption storm: {n} preemptions in the last {self.storm_window} steps "
                                f"(requests {victims[:10]}{' ...' if len(victims) > 10 else ''}); each one "
                                f"recomputes its prompt",
                        hint=self._hint(), kind="preemption-storm", step=step, request_id=victims[0],
                        dedup=("preemption-storm", step // (4 * self.storm_window)),
                        evidence={"preemptions": n, "window": self.storm_window, "requests": victims})
            self._storm.clear()

    def reset(self) -> None:
        super().reset()
        self._storm.clear()
        self._high = 0
        self.total_preemptions = 0

    def frame(self):
        import pandas as pd
        cols = ["step", "pages_total", "pages_used", "usage", "pages_free", "pages_cached", "live_seqs", "waiting",
                "live_tokens", "waste_slots", "waste_share", "shared_saved_pages", "unmapped_pages", "preemptions",
                "contiguous_max_len_pages", "contiguous_request_pages", "paged_vs_max_len"]
        return pd.DataFrame(self.rows, columns=cols)
