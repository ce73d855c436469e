"""The engine core's requests accounted for: probes/request_books.py, the books our engine keeps too.

Handed out: each new request Scheduler.add_request receives (EngineCore.add_request's one call into
the scheduler, on every step path). Ended: the requests Scheduler.finish_requests reports finished
(aborts, a streaming session's end) and the outputs update_from_output returns with a finish
reason (stops, lengths). Places, read after update_from_output every `every` steps and when vLLM
goes idle: waiting (and kv_holding_waiting, where this vLLM has it), preempted (waiting again after
a preemption) and running. A request added and then in none of them (lost between the add and the
queues), in two, ended twice, or ended and still queued is an error naming it.
"""
from __future__ import annotations

from probes.request_books import RequestBooks, ended_state

from . import sanitizer

PROBE = "request_lifecycle"


class RequestWatch:
    def __init__(self, rep, every: int = 8):
        self.rep, self.every = rep, every
        self.books = RequestBooks(grace_steps=2)
        self.step = 0

    def on_add(self, scheduler, request) -> None:
        self.books.handed_out(str(request.request_id), self.step)

    def on_finish_requests(self, scheduler, finished) -> None:
        for r in finished or ():
            status = getattr(getattr(r, "status", None), "name", "FINISHED")
            self._say(self.books.ended_now(str(r.request_id), ended_state(status), self.step, status))

    def on_update(self, scheduler, outputs) -> None:
        self.step += 1
        for eco in (outputs or {}).values():
            for o in getattr(eco, "outputs", None) or ():
                reason = getattr(o, "finish_reason", None)
                if reason is not None:
                    self._say(self.books.ended_now(str(o.request_id), ended_state(reason), self.step, str(reason)))
        if self.step % self.every == 0 or not scheduler.requests:
            for p in self.books.reconcile(self.step, places(scheduler)):
                self._say(p)

    def _say(self, p) -> None:
        if p is None:
            return
        self.rep.findings([sanitizer.finding(PROBE, f"request-{p.kind}", "warn" if p.kind == "unknown" else "error",
                                             f"vLLM {p.message}", p.step, p.request, None, **p.evidence)],
                          key=lambda f: (f["kind"], f["request_id"]))


def places(scheduler) -> dict[str, list[str]]:
    """Where vLLM's scheduler holds each request now (its own queues, as this version has them)."""
    waiting, preempted = [], []
    for name in ("waiting", "kv_holding_waiting"):
        for r in getattr(scheduler, name, None) or ():
            (preempted if "PREEMPTED" in getattr(r.status, "name", "") else waiting).append(str(r.request_id))
    return {"waiting": waiting, "preempted": preempted,
            "running": [str(r.request_id) for r in scheduler.running]}
