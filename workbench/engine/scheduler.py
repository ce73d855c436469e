"""Continuous batching: a token budget per step, chunked prefill, FCFS admission by free
pages, preemption by recompute when the pool runs dry.

Running sequences are served first, in admission order; when one cannot grow, the
latest-admitted running sequence is preempted (its pages freed, its progress dropped)
and re-queued at the front, so the oldest work always makes progress. Waiting requests
are admitted strictly in order and only in steps with no preemption.
"""
from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field

from . import lifecycle, seq_ops
from .kv_manager import KVCacheManager
from .sequence import Sequence, SeqStatus


_second = operator.itemgetter(1)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, tokens this step)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(map(_second, self.scheduled))


class Scheduler:
    # Fault seams: `finish` (a finish that leaves the request queued: abort_leaves_waiting).
    FAULT_SEAMS = frozenset({"finish"})

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01, ops: str = "auto"):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_pages = int(watermark * kv.pool.num_pages)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._ops = seq_ops.active(ops)          # EngineConfig.pool_ops: "python" keeps the Python loops

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv, running, scheduled = self.kv, self.running, out.scheduled
        ps = kv.page_size
        fit = self._ops.fit_running
        i = 0
        while True:
            # Sequences whose tokens fit the pages they map, in one call (seq_ops: compiled where
            # it builds); it stops at the first that needs pages: grow it, or preempt for it.
            i, budget = fit(running, i, budget, ps, scheduled)
            if i >= len(running) or budget <= 0:
                break
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not kv.grow(seq, n):
                victim = running.pop()            # latest admitted goes first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.watermark_pages if self.running else 0
            n = self.kv.try_admit(seq, budget, reserve)
            if n == 0:
                break                              # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            out.admitted.append(seq)
            budget -= n
        return out

    def update_from_output(self, sched: SchedulerOutput, out, now: float,
                           eos_token_ids=frozenset()) -> tuple[list[Sequence], list[Sequence]]:
        """Apply a step's results (out: a ModelRunnerOutput): every scheduled sequence's tokens are
        computed, its newly full pages registered in the prefix cache; each sampled sequence takes
        its token and the ones that stop are finished (pages back). Returns (produced, finished),
        in batch order. The engine and the simulator both end their step here.

        A cost model's output has no tokens (out.tokens None): each sequence whose context is then
        computed produces one counted token and stops by the length rule alone, in one loop over
        the batch (seq_ops.advance, compiled where it builds: a replay runs it ~90k times)."""
        kv, finished = self.kv, []
        if out.tokens is None:
            produced, special = [], []
            ps, register = kv.page_size, kv.enable_prefix_caching
            self._ops.advance(sched.scheduled, ps, register, now, produced, special)
            for seq, done in special:                     # a page filled, or the length rule stops it
                if register and seq.num_computed_tokens // ps > len(seq.page_hashes):
                    kv.cache_full_pages(seq)
                if done:
                    self._finish_at(seq, "length", now, finished)
            return produced, finished
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            kv.cache_full_pages(seq)
        for seq, first, entries in out.prompt_logprobs or ():
            store = seq.prompt_logprobs
            base = first + 1 - seq.params.prompt_logprobs_from
            if len(store) < base + len(entries):
                store.extend([None] * (base + len(entries) - len(store)))
            store[base:base + len(entries)] = entries
        for row, lp in (out.logprobs or {}).items():
            out.sampled[row].logprobs.append(lp)
        for seq, tok in zip(out.sampled, out.tokens):
            seq.append_token(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = lifecycle.stop_reason(seq, tok, eos_token_ids)
            if reason is not None:
                self._finish_at(seq, reason, now, finished)
        return out.sampled, finished

    def _finish_at(self, seq: Sequence, reason: str, now: float, finished: list) -> None:
        self.finish(seq, reason)
        seq.finish_time = now
        finished.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.last_preemption = (len(seq.pages), seq.num_computed_tokens)
        self._drop(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _drop(self, seq: Sequence) -> None:
        """Pages back, progress gone, waiting again: it is recomputed when next admitted."""
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SeqStatus.WAITING

    def release_all(self) -> list[Sequence]:
        """Every live request out of this scheduler, as a preemption that is not counted as one (a
        repage moves them to another stack): running first, then waiting, in order."""
        live = self.running + list(self.waiting)
        for seq in live:
            self._drop(seq)
        self.running.clear()
        self.waiting.clear()
        return live

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq wherever it is and give its pages back."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
