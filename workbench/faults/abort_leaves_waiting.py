"""abort_leaves_waiting: aborting a request that is still waiting marks it finished and frees its
pages but leaves it in the waiting queue.

The caller got its abort; the scheduler later admits the finished request again, computes it
and finishes it a second time, on pages and seats other requests were owed.
"""
from __future__ import annotations

from ..engine.sequence import SeqStatus
from .base import Fault


class AbortLeavesWaiting(Fault):
    name = "abort_leaves_waiting"
    symptom = "aborted requests keep consuming seats and pages; a second final output for an aborted request"
    cause = "Scheduler.finish removes a request from running but not from waiting"
    caught_by = "request_lifecycle probe: an ended request is still queued (request-ended-but-queued)"
    fix = "remove a finished request from whichever queue holds it (Scheduler.finish)"
    notebook = ""

    def on_enable(self) -> None:
        sched = self.engine.scheduler
        kv = sched.kv
        finish = sched.finish
        self.left: list[int] = []                 # request ids left in waiting

        def finish_forgetting_waiting(seq, reason):
            if seq.status is SeqStatus.WAITING:
                self.left.append(seq.request_id)
                kv.release(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = reason
                return
            finish(seq, reason)

        self.patch(sched, "finish", finish_forgetting_waiting)
