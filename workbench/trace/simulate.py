"""Simulate mode: the real scheduler and page pool, a cost model in place of the forward.

Prompts are never materialised: a SimSequence knows its length and, for traces with
prefix-block hash ids, what each page holds (hash id, offset), which is all the prefix
cache compares. So a whole production trace replays in seconds and the page accounting
is the same as a full replay of the same schedule.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..engine import lifecycle
from ..engine.config import EngineConfig
from ..engine.model_runner import ModelRunnerOutput
from ..engine.instrumentation import pool_observer, wants_pool_events
from ..engine.sequence import SamplingParams, Sequence
from ..engine.stack import build_stack
from ..events import BatchPacked, EventBus, RequestArrived, StepFinished


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


class CostModelRunner:
    """The simulator's ModelRunner (engine/model_runner.py): its only input is the step's token count
    (prepare), no forward; a step takes StepCost's seconds and each sequence whose context is computed
    produces a counted token."""

    def __init__(self, cost: StepCost):
        self.cost = cost

    def prepare(self, sched) -> int:
        return sched.num_tokens

    def execute(self, sched, num_tokens: int) -> ModelRunnerOutput:
        return ModelRunnerOutput(None, None, seconds=self.cost(num_tokens) if sched.scheduled else 0.0)


@functools.lru_cache(maxsize=64)
def _offsets(per: int) -> tuple[int, ...]:
    return tuple(range(0, 2 * per, 2))


class SimSequence(Sequence):
    # Plain attributes here (properties on Sequence): the scheduler reads them every step.
    num_tokens = 0
    num_prompt_tokens = 0

    def __init__(self, request_id: int, prompt_len: int, params: SamplingParams, max_len: int,
                 hash_ids=None, hash_block_size: int | None = None, user_request_id=None, arrival_time: float = 0.0):
        super().__init__(request_id, [], params, max_len, arrival_time=arrival_time, user_request_id=user_request_id)
        self.prompt_len = prompt_len
        self.num_tokens = prompt_len
        self.num_prompt_tokens = prompt_len
        self.hash_ids = hash_ids
        self.block = hash_block_size or 0
        self.num_output = 0
        self.stop_at = lifecycle.length_limit(self)       # the length rule, as a token count
        self._ids_np = None                                # hash_ids as int64 (page_keys), made on first use

    @property
    def num_output_tokens(self) -> int:
        return self.num_output

    def pages_known(self, i: int, ps: int) -> int:
        # Every page it will fill is known from the start (the prompt's hash ids, then unique
        # content): hashed in one call, not one call per page filled while it decodes.
        return max(i + 1, (self.stop_at - 1) // ps)

    def append_token(self, token_id: int = 0) -> None:
        self.num_tokens += 1
        self.num_output += 1

    # What a page holds, as a key the prefix cache compares. A page inside one hash block is
    # that block's id and the page's place in it, packed in one even int (id * per + place, a
    # bijection for any int id); a page of unique content (past the hashed prompt) is an odd int
    # made of the request and page index; a page straddling two blocks is a tuple. Ints, not
    # tuples: a replay keeps millions of these alive, and an int is one small object.
    def page_key(self, i: int, ps: int):
        start, end = i * ps, (i + 1) * ps
        if self.hash_ids and end <= self.prompt_len:
            b0, b1 = start // self.block, (end - 1) // self.block
            if b0 == b1:
                if self.block % ps == 0:
                    per = self.block // ps
                    return 2 * (self.hash_ids[b0] * per + (start - b0 * self.block) // ps)
                return (self.hash_ids[b0], start - b0 * self.block)
            return (self.hash_ids[b0], start - b0 * self.block, self.hash_ids[b1])
        return 2 * ((self.request_id << 32) | i) + 1          # nothing shared: unique content

    def _ids_array(self, step: int):
        """The hash ids as int64, when every key they make fits in one (else None: Python ints)."""
        if self._ids_np is None:
            ids = self.hash_ids
            big = max(map(abs, ids), default=0)
            self._ids_np = (np.asarray(ids, dtype=np.int64) if (big + 1) * step < 2 ** 62 else False)
        return self._ids_np if self._ids_np is not False else None

    def page_keys(self, start: int, stop: int, ps: int) -> list:
        """page_key for pages start..stop-1 in one go (a long prompt has thousands)."""
        shared = min(stop, self.prompt_len // ps) if self.hash_ids else 0     # pages inside the prompt
        ids, blk = self.hash_ids, self.block
        if shared <= start:
            keys = []
        elif blk % ps == 0:                      # no page straddles two hash blocks
            per = blk // ps
            step = 2 * per
            arr = self._ids_array(step)
            if arr is not None and shared - start >= 32:    # a prompt's pages at once, in numpy
                i = np.arange(start, shared)
                keys = (arr[i // per] * step + (i % per) * 2).tolist()
            else:
                offs = _offsets(per)
                keys = [ids[i // per] * step + offs[i % per] for i in range(start, shared)]
        else:
            keys = [self.page_key(i, ps) for i in range(start, shared)]
        base = 2 * (self.request_id << 32) + 1
        keys += range(base + 2 * max(start, shared), base + 2 * stop, 2)
        return keys


class Simulator:
    """Engine-shaped (add_request / step / has_unfinished / stats) with no model."""

    def __init__(self, config: EngineConfig, cost: StepCost | None = None, bus: EventBus | None = None):
        if config.num_pages is None:
            raise ValueError("simulate mode needs EngineConfig(num_pages=...): a KV byte budget needs a model")
        self.config = config
        self.runner = CostModelRunner(cost or StepCost())
        # The engine's own pool, KV manager and scheduler (engine/stack.py), without tensors.
        self.stack = build_stack(config, config.num_pages)
        self.pool, self.kv_manager, self.scheduler = self.stack.pool, self.stack.kv_manager, self.stack.scheduler
        self.max_model_len = config.max_model_len or (1 << 31)
        self.bus = bus or EventBus()
        self.step_count = 0
        self.clock = 0.0
        self.last_num_tokens = 0
        self.last_finished: list[SimSequence] = []     # the sequences the last step finished
        self._next_id = 0
        self.bus.on_change.append(self._rewire)
        self._rewire()

    @property
    def cost(self) -> StepCost:
        return self.runner.cost

    @cost.setter
    def cost(self, cost: StepCost) -> None:
        self.runner.cost = cost

    def _rewire(self) -> None:
        if wants_pool_events(self.bus):
            self.pool.observer = pool_observer(self.bus, lambda: (self.step_count, int(self.clock * 1e9)))
        else:
            self.pool.observer = None

    def add_request(self, prompt_len: int, max_tokens: int, hash_ids=None, hash_block_size=None,
                    request_id=None) -> int:
        ps, n = self.config.page_size, self.pool.num_pages
        lifecycle.check_prompt_len(prompt_len, self.max_model_len, n, ps)      # RequestRejected, a ValueError
        rid = self._next_id
        self._next_id += 1
        seq = SimSequence(rid, prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          lifecycle.max_len(prompt_len, max_tokens, self.max_model_len, n, ps), hash_ids,
                          hash_block_size, request_id, self.clock)
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
        scheduled = sched.scheduled
        t = int(self.clock * 1e9)
        lifecycle.emit_schedule(bus, step, t, sched)
        n_tok = self.runner.prepare(sched)          # the cost model's one input: the step's tokens
        self.last_num_tokens = n_tok
        if scheduled and bus.wants(BatchPacked):
            lifecycle.emit_packed(bus, step, t, sched)
        # The engine's two calls: the cost model's "forward" (no tokens, a step time), then the
        # scheduler applies it exactly as it applies a real forward's output.
        out = self.runner.execute(sched, n_tok)
        dt = out.seconds
        self.clock += dt
        clock = self.clock
        produced, finished = self.scheduler.update_from_output(sched, out, clock)
        for seq in finished:
            lifecycle.emit_finished(bus, step, int(clock * 1e9), seq)
        self.last_finished = finished
        if bus.wants(StepFinished):
            lifecycle.emit_step(bus, step, int(clock * 1e9), int(dt * 1e9), sched, self.pool, self.scheduler)
        return produced

    def stats(self) -> dict:
        return lifecycle.stats(self.pool, self.scheduler, self.kv_manager, self.step_count)
