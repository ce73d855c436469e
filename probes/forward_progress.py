"""forward_progress: requests that wait while the pool has room for them, on our own engine.

The same judgement as the vLLM plugin's (probes/progress.py's `stalled`, one implementation,
two callers): a waiting request (new or preempted) that has not been admitted for `after`
steps, although the free pages would hold its next chunk, is stalled. A step that was
saturated (every seat taken, the whole token budget used, or a preemption) is a fair reason to
wait and restarts every waiting request's clock. With others running it is a `warn` (head-of-
line blocking: the queue behind it waits too); our engine itself stops with "scheduler stalled"
once nothing runs, which is the hang.

Read from the scheduler's waiting queue and the pool's free count after each step, never from
a flag the admission path sets. Cost: O(waiting requests) every `every` steps.
"""
from __future__ import annotations

from typing import Any

from workbench.events import StepFinished
from workbench.probe import Probe

from .progress import stalled

HINT = ("the pool holds this request's next chunk, yet admission refuses it: look at the free-page arithmetic "
        "of admission (KVCacheManager.try_admit, the watermark reserve), a reservation never released, or a "
        "request at the head of the FCFS queue that blocks the rest")


class ForwardProgressProbe(Probe):
    name = "forward_progress"
    description = "waiting requests not admitted for N steps while the pool could hold them (stalls, hangs)"

    def __init__(self, after: int = 64, every: int = 8, **params: Any):
        super().__init__(after=after, every=every, **params)
        for k, v in (("after", after), ("every", every)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive int, got {v!r}")
        self.after, self.every = after, every
        self.since: dict[Any, int] = {}          # waiting request -> the step it was first seen waiting
        self.saturated_at = 0
        self._preemptions = 0

    def on_attach(self, engine) -> None:
        self.listen(StepFinished, self._on_step)

    def _on_step(self, e: StepFinished) -> None:
        sched = self.engine.scheduler
        step = e.step
        if (len(sched.running) >= sched.max_num_seqs or e.num_tokens >= sched.max_num_batched_tokens
                or e.num_preemptions > self._preemptions):
            self.saturated_at = step
        self._preemptions = e.num_preemptions
        waiting = list(sched.waiting)
        ids = {s.request_id for s in waiting}
        for rid in [r for r in self.since if r not in ids]:
            del self.since[rid]                  # admitted (or finished): its clock stops
        for s in waiting:
            self.since.setdefault(s.request_id, step)
        if step % self.every:
            return
        ps = self.engine.pool.page_size
        reserve = sched.watermark_pages if sched.running else 0
        need = {s.request_id: -(-min(s.num_tokens - s.num_computed_tokens, sched.max_num_batched_tokens) // ps)
                + reserve for s in waiting}
        table = {rid: (max(self.since[rid], self.saturated_at), need[rid]) for rid in ids}
        free = self.engine.pool.num_free
        found = stalled(step, table, free, self.after)
        running = len(sched.running)
        self.rows.append({"step": step, "waiting": len(waiting), "running": running, "free_pages": free,
                          "stalled": len(found)})
        for rid, waited, pages in found:
            hang = running == 0
            self.report("error" if hang else "warn",
                        f"request {rid} has waited {waited} steps unadmitted although the pool has {free} free pages "
                        f"and its next chunk needs {pages}" + (" (nothing is running: the engine is hung)" if hang
                                                                else f" ({running} requests running)"),
                        hint=HINT, kind="stalled", dedup=("stalled", rid), step=step, request_id=rid,
                        evidence={"waited": waited, "free_pages": free, "needs": pages, "running": running,
                                  "waiting": len(waiting)})
