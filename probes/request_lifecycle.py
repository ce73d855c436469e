"""request_lifecycle: every request add_request handed out is in one place after each step, and ends once.

The books (probes/request_books.py, shared with the vLLM plugin) are kept from the submission API
(RequestSubmitted, emitted after the request is queued) and the terminal states the engine
reports (RequestFinished: finished or aborted), never from the scheduler's lists alone; after
each step (StepFinished, and when the engine goes idle) they are reconciled with the places the
engine's own structures hold: the intake queue (RequestIntake.pending()), waiting, preempted
(waiting again after a preemption) and running. A request in no place (lost between the
submission queue and the scheduler, say), in two, ended twice, or ended and still queued is an
error naming the request, where it was last seen and at which step.

Cost: one pass over the live requests a step (a dict and a few sets).
"""
from __future__ import annotations

from typing import Any

from probes.request_books import HINTS, RequestBooks, ended_state
from workbench.events import EngineIdle, RequestFinished, RequestSubmitted, StepFinished
from workbench.probe import Probe

class RequestLifecycleProbe(Probe):
    name = "request_lifecycle"
    description = "every request handed out is in exactly one place after each step and ends exactly once"

    def __init__(self, grace_steps: int = 8, **params: Any):
        super().__init__(grace_steps=grace_steps, **params)
        self.books = RequestBooks(grace_steps=grace_steps)

    def on_attach(self, engine) -> None:
        # RequestSubmitted arrives on the submitter's thread: only an append there (handed_out)
        self.listen(RequestSubmitted, lambda e: self.books.handed_out(e.request_id, e.step))
        self.listen(RequestFinished, self.on_finished)
        self.listen(StepFinished, lambda e: self.reconcile(e.step))
        self.listen(EngineIdle, lambda e: self.reconcile(e.step))

    def on_finished(self, e: RequestFinished) -> None:
        problem = self.books.ended_now(e.request_id, ended_state(e.reason), e.step, e.reason)
        if problem is not None:
            self._report(problem)

    def places(self) -> dict[str, list]:
        """Where the engine's own structures hold each request now."""
        eng = self.engine
        sched = eng.scheduler
        waiting, preempted = [], []
        for s in sched.waiting:
            (preempted if s.num_preemptions else waiting).append(s.request_id)
        return {"intake": eng.intake.pending(), "waiting": waiting, "preempted": preempted,
                "running": [s.request_id for s in sched.running]}

    def reconcile(self, step: int) -> None:
        for problem in self.books.reconcile(step, self.places()):
            self._report(problem)
        self.rows.append({"step": step, **self.books.counts()})
        if len(self.rows) > 100_000:
            del self.rows[:50_000]

    def _report(self, p) -> None:
        self.report("warn" if p.kind == "unknown" else "error", p.message, hint=HINTS[p.kind],
                    kind=f"request-{p.kind}", step=p.step, request_id=p.request,
                    dedup=(p.kind, p.request), evidence=dict(p.evidence))

    def frame(self):
        """One row per reconciliation: requests handed out, live (by the place last seen), ended."""
        import pandas as pd
        return pd.DataFrame(self.rows)
