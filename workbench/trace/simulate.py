"""Simulate mode: the real scheduler and page pool, a cost model in place of the forward.

Prompts are never materialised: a SimSequence knows its length and, for traces with
prefix-block hash ids, what each page holds (hash id, offset), which is all the prefix
cache compares. So a whole production trace replays in seconds and the page accounting
is the same as a full replay of the same schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import EngineConfig
from ..engine.instrumentation import POOL_EVENTS as _POOL_EVENTS, pool_event
from ..engine.kv_manager import KVCacheManager, pages_for
from ..engine.pages import PagePool
from ..engine.scheduler import Scheduler
from ..engine.sequence import SamplingParams, Sequence
from ..events import (BatchPacked, EventBus, RequestAdmitted, RequestArrived, RequestFinished, RequestPreempted, StepFinished)


@dataclass
class StepCost:
    """Seconds one step takes: per_step + per_token x tokens. The default is an
    accelerator-class engine (50k prefill tokens/s, 8 ms per decode step); fit() calibrates
    it from a measured run's StepFinished frame."""
    per_step_s: float = 0.008
    per_token_s: float = 0.00002

    def __call__(self, num_tokens: int) -> float:
        return self.per_step_s + self.per_token_s * num_tokens

    @classmethod
    def fit(cls, steps) -> "StepCost":
        import numpy as np
        x = np.asarray(steps["num_tokens"], dtype=float)
        y = np.asarray(steps["duration_ns"], dtype=float) / 1e9
        a = np.vstack([np.ones_like(x), x]).T
        (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
        return cls(max(float(c0), 0.0), max(float(c1), 0.0))


class SimSequence(Sequence):
    def __init__(self, request_id: int, prompt_len: int, params: SamplingParams, max_len: int,
                 hash_ids=None, hash_block_size: int | None = None, user_request_id=None, arrival_time: float = 0.0):
        super().__init__(request_id, [], params, max_len, arrival_time=arrival_time, user_request_id=user_request_id)
        self.prompt_len = prompt_len
        self._num_tokens = prompt_len
        self.hash_ids = hash_ids
        self.block = hash_block_size or 0
        self.num_output = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    def append_token(self, token_id: int = 0) -> None:
        self._num_tokens += 1
        self.num_output += 1

    def page_key(self, i: int, ps: int) -> tuple:
        start, end = i * ps, (i + 1) * ps
        if self.hash_ids and end <= self.prompt_len:
            b0, b1 = start // self.block, (end - 1) // self.block
            if b0 == b1:
                return (self.hash_ids[b0], start - b0 * self.block)
            return (self.hash_ids[b0], start - b0 * self.block, self.hash_ids[b1])
        return (-1, self.request_id, i)          # nothing shared: unique content


class Simulator:
    """Engine-shaped (add_request / step / has_unfinished / stats) with no model."""

    def __init__(self, config: EngineConfig, cost: StepCost | None = None, bus: EventBus | None = None):
        if config.num_pages is None:
            raise ValueError("simulate mode needs EngineConfig(num_pages=...): a KV byte budget needs a model")
        self.config = config
        self.cost = cost or StepCost()
        self.pool = PagePool(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.watermark)
        self.max_model_len = config.max_model_len or (1 << 31)
        self.bus = bus or EventBus()
        self.bus.on_change.append(self._rewire)
        self._rewire()
        self.step_count = 0
        self.clock = 0.0
        self.last_num_tokens = 0
        self._next_id = 0

    def _rewire(self) -> None:
        bus = self.bus
        if any(bus.wants(t) for t in _POOL_EVENTS.values()):
            def observer(kind, pages, **detail):
                if bus.wants(_POOL_EVENTS[kind]):
                    bus.emit(pool_event(kind, pages, self.pool, self.step_count, int(self.clock * 1e9), **detail))
            self.pool.observer = observer
        else:
            self.pool.observer = None

    def add_request(self, prompt_len: int, max_tokens: int, hash_ids=None, hash_block_size=None,
                    request_id=None) -> int:
        ps = self.config.page_size
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if pages_for(prompt_len + 1, ps) > self.pool.num_pages:
            raise ValueError(f"prompt of {prompt_len} tokens needs {pages_for(prompt_len + 1, ps)} pages, "
                             f"more than the whole pool ({self.pool.num_pages} pages)")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {prompt_len} tokens does not fit max_model_len {self.max_model_len}")
        rid = self._next_id
        self._next_id += 1
        cap = min(self.max_model_len, self.pool.num_pages * ps)
        seq = SimSequence(rid, prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          min(cap, prompt_len + max_tokens), hash_ids, hash_block_size, request_id, self.clock)
        self.scheduler.add(seq)
        if self.bus.wants(RequestArrived):
            self.bus.emit(RequestArrived(self.step_count, int(self.clock * 1e9), rid, prompt_len, max_tokens))
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[SimSequence]:
        """One scheduling step; returns the sequences that produced a token (finished ones included)."""
        self.step_count += 1
        bus, step = self.bus, self.step_count
        sched = self.scheduler.schedule()
        t = int(self.clock * 1e9)
        if sched.preempted and bus.wants(RequestPreempted):
            for s in sched.preempted:
                bus.emit(RequestPreempted(step, t, s.request_id, *s.last_preemption))
        if sched.admitted and bus.wants(RequestAdmitted):
            for s in sched.admitted:
                bus.emit(RequestAdmitted(step, t, s.request_id, s.num_cached_tokens, len(s.pages)))
        n_tok = sched.num_tokens
        self.last_num_tokens = n_tok
        if bus.wants(BatchPacked) and sched.scheduled:
            q = [n for _, n in sched.scheduled]
            bus.emit(BatchPacked(step, t, tuple(s.request_id for s, _ in sched.scheduled), tuple(q),
                                 tuple(s.num_computed_tokens + n for s, n in sched.scheduled), n_tok,
                                 sum(1 for x in q if x > 1), sum(1 for x in q if x == 1)))
        dt = self.cost(n_tok) if sched.scheduled else 0.0
        self.clock += dt
        produced = []
        kv = self.kv_manager
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            kv.cache_full_pages(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token()
                if seq.first_token_time is None:
                    seq.first_token_time = self.clock
                if seq.num_output >= seq.params.max_tokens or seq.num_tokens >= seq.max_len:
                    self.scheduler.finish(seq, "length")
                    seq.finish_time = self.clock
                    if bus.wants(RequestFinished):
                        bus.emit(RequestFinished(step, int(self.clock * 1e9), seq.request_id, "length",
                                                 seq.prompt_len, seq.num_output, seq.num_preemptions,
                                                 seq.first_token_time - seq.arrival_time,
                                                 seq.finish_time - seq.arrival_time))
                produced.append(seq)
        if bus.wants(StepFinished):
            q_pre = sum(n for _, n in sched.scheduled if n > 1)
            bus.emit(StepFinished(step, int(self.clock * 1e9), int(dt * 1e9), n_tok, len(sched.scheduled),
                                  q_pre, n_tok - q_pre, 0, 0, 0, self.pool.num_used, self.pool.num_cached_free,
                                  len(self.scheduler.running), len(self.scheduler.waiting),
                                  self.scheduler.num_preemptions))
        return produced

    def stats(self) -> dict:
        pool = self.pool
        return {"pages_total": pool.num_pages, "pages_used": pool.num_used, "pages_cached": pool.num_cached_free,
                "pages_free": pool.num_free, "kv_cache_usage": pool.usage(),
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.kv_manager.prefix_cache_queries,
                "prefix_cache_hits": self.kv_manager.prefix_cache_hits,
                "num_evictions": pool.num_evictions, "steps": self.step_count}
