"""intake_loses_request: a request accepted by add_request is dropped between the submission
queue and the scheduler (a race in the hand-over, an exception swallowed while draining).

add_request returned its id, so its caller waits for its output forever; the scheduler never
saw it, so nothing that watches the waiting queue (forward_progress) can say anything.
"""
from __future__ import annotations

from .base import Fault


class IntakeLosesRequest(Fault):
    name = "intake_loses_request"
    symptom = "a caller waits forever for one request; the engine is idle or serving the others, no error"
    cause = "the intake drains a queued request and never hands it to the scheduler"
    caught_by = "request_lifecycle probe: a request handed out by add_request is in no place (request-lost)"
    fix = "move requests from the submission queue to the scheduler in one step that cannot drop one " \
          "(step.py drain_inbox), and account for every id handed out"
    notebook = ""

    def __init__(self, engine, nth: int = 1):
        """Drop the nth request drained while the fault is on (1: the first)."""
        super().__init__(engine, nth=nth)
        if nth < 1:
            raise ValueError(f"nth={nth} must be >= 1")
        self.nth = nth

    def on_enable(self) -> None:
        intake = self.engine.intake
        drain = intake.drain
        self.seen = 0
        self.lost: list[int] = []                 # the request ids dropped

        def drain_dropping():
            out = drain()
            kept = []
            for kind, item in out:
                if kind == "add":
                    self.seen += 1
                    if self.seen == self.nth:
                        self.lost.append(item.request_id)
                        continue
                kept.append((kind, item))
            return kept

        self.patch(intake, "drain", drain_dropping)
