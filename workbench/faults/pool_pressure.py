"""pool_pressure: long-tail traffic on a pool too small for it.

Production sized the pool from the mean request length; the long tail then filled it,
and the scheduler preempted (recomputed) request after request, or ran out of memory
(field note 10). Enabling this fault takes pages out of the live PagePool, so only
`usable` (a share of the pool, default 0.25) is left for requests; the taken pages
count as used, as memory lost to another tenant would. Run long-tail traffic
(long_tail_prompts) on it and preemptions storm. disable() gives the pages back.

The longest request must still fit the usable pages, or the engine stops with a
'scheduler stalled' error: the OOM of this failure.
"""
from __future__ import annotations

import numpy as np

from probes.pool import advise_pool_size
from .base import Fault


def long_tail_prompts(n: int, seed: int = 0, median: int = 24, p99: int = 320, vocab: int = 256,
                      max_len: int | None = None) -> list[list[int]]:
    """n prompts of token ids with log-normal lengths: most near `median`, 1% past `p99`."""
    rng = np.random.default_rng(seed)
    sigma = np.log(p99 / median) / 2.326                    # z of the 99th percentile
    lens = np.exp(rng.normal(np.log(median), sigma, n)).astype(int).clip(2, max_len or 10 * p99)
    return [rng.integers(3, vocab, int(k)).tolist() for k in lens]


RESERVATION = "pool_pressure reservation"


class PoolPressure(Fault):
    name = "pool_pressure"
    symptom = "preemption storms and OOM on long-tail traffic"
    cause = "the KV pool is sized from the mean request length (or max_len guesswork), so the long tail fills it"
    caught_by = "pool probe: usage above 0.95 (error, with the sizing hint) and preemption storms"
    fix = "size the pool as ceil(batch x P99 length / page_size) x 1.3 (advise_pool_size)"
    notebook = "notebooks/pool_pressure.ipynb"

    def __init__(self, engine, usable: float = 0.25):
        """usable: the share of the pool left to requests."""
        super().__init__(engine, usable=usable)
        if not 0 < float(usable) <= 1:
            raise ValueError(f"usable={usable} must be a share of the pool in (0, 1]")
        self.usable = float(usable)

    def on_enable(self) -> None:
        e = self.engine
        pool = e.pool
        usable = self.usable
        keep = max(1, int(pool.num_pages * usable))
        with e.lock:
            take = max(0, min(pool.num_pages - keep, pool.num_free))
            self.pool = pool
            # a named owner: the pages belong to no request
            self.reserved = pool.allocate(take, RESERVATION) if take else []

    def on_disable(self) -> None:
        with self.engine.lock:
            if self.reserved:
                self.pool.free(self.reserved, RESERVATION)
            self.reserved = []


__all__ = ["PoolPressure", "advise_pool_size", "long_tail_prompts"]
