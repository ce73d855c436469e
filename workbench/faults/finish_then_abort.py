"""finish_then_abort: a finished request stays reachable, so an abort that arrives after its
finish (a client that disconnects as the last token streams) finishes it a second time.

The caller gets two final outputs for one request, its pages are released twice (a no-op
here, a double free in engines that count), and metrics count it twice.
"""
from __future__ import annotations

from .base import Fault


class FinishThenAbort(Fault):
    name = "finish_then_abort"
    symptom = "two final outputs for one request (stop, then abort); request counters drift"
    cause = "the finish path leaves the request in the engine's table of live requests, where a late " \
            "abort finds it and finishes it again"
    caught_by = "request_lifecycle probe: a request reached a terminal state twice (request-ended-twice)"
    fix = "drop a request from every table at its finish (LiveRequests.forget), and ignore aborts of " \
          "requests that already ended"
    notebook = ""

    def on_enable(self) -> None:
        reqs = self.engine.requests
        self.kept: list[int] = []                 # finished request ids left reachable

        def forget_nothing(request_id):
            self.kept.append(request_id)
            return None

        self.patch(reqs, "forget", forget_nothing)
