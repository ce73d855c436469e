"""RequestBooks: every request handed out is in exactly one place, and ends exactly once.

Both engines keep their requests in several structures (an intake queue, waiting, running, ...)
and lose them in the gaps: a request accepted and dropped between the submission queue and the
scheduler waits forever, and no check that watches the scheduler's lists sees it, because it
never reaches them. These books are kept from what the submission API handed out (the ids
add_request returned) and from the terminal states the engine reported, and after each step they
are reconciled with where the engine's structures say each request is:

- a request handed out and not ended must be in exactly one place (`lost`: in none; `two-places`);
- a request must end (finish, abort) exactly once (`ended-twice`);
- an ended request must be in no place (`ended-but-queued`);
- a request in a place that was never handed out (`unknown`) is reported only once it has stayed
  unknown for `grace_steps` reconciliations: a submitter thread may put a request in the queue and
  be descheduled before it says so.

Engine-agnostic (ids are any hashable): our engine's probe (probes/request_lifecycle.py) and the
vLLM plugin's engine-core side keep the same books. handed_out() may be called from any thread
(an append to a deque); everything else runs on the thread that steps the engine.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

HINTS = {
    "lost": "a request accepted by add_request never reached the scheduler's queues (or left them without "
            "finishing): check what moves requests from the submission queue to the scheduler and every path "
            "that removes one from waiting / running; its caller waits forever",
    "two-places": "a request sits in two queues at once: a move (admission, preemption) that appended it "
                  "without removing it",
    "ended-twice": "a request reached a terminal state twice (a finish and an abort that raced, or a finish "
                   "that left it reachable): its caller sees two final outputs and its pages are released twice",
    "ended-but-queued": "a finished request is still queued: the finish path did not remove it from waiting / "
                        "running, so it may be scheduled again",
    "unknown": "a request is queued that the submission API never handed out",
}


def ended_state(reason) -> str:
    """"aborted" for an abort (our engine's "abort", vLLM's FINISHED_ABORTED / FinishReason.ABORT), else
    "finished": the one rule both engines' books end a request by."""
    return "aborted" if "abort" in str(reason).lower() else "finished"


@dataclass
class BookProblem:
    kind: str                    # lost | two-places | ended-twice | ended-but-queued | unknown
    request: object
    step: int
    message: str
    evidence: dict = field(default_factory=dict)


class RequestBooks:
    def __init__(self, grace_steps: int = 8, max_ended: int = 200_000):
        self.grace_steps = grace_steps
        self.max_ended = max_ended
        self._handed: deque = deque()                # (id, step) appended by submitter threads
        self.live: dict[object, tuple[str, int]] = {}    # handed out, not ended -> (last place seen, step)
        self.ended: dict[object, tuple[str, int, str]] = {}   # -> (state, step, reason), the newest max_ended
        self._unknown: dict[object, int] = {}        # in a place, never handed out -> reconciliations so seen
        self._said: set = set()
        self.handed_out_count = 0
        self.ended_count = 0
        self.reconciled = 0

    # ---- what the submission API and the engine report ------------------------------------------
    def handed_out(self, request, step: int) -> None:
        """add_request returned this id (any thread; call it after the request is queued)."""
        self._handed.append((request, step))

    def _take_handed(self) -> None:
        while self._handed:
            rid, step = self._handed.popleft()
            if rid in self.live or rid in self.ended:
                continue
            self.live[rid] = ("intake", step)
            self._unknown.pop(rid, None)
            self.handed_out_count += 1

    def ended_now(self, request, state: str, step: int, reason: str = "") -> BookProblem | None:
        """The engine reported request's terminal state (finished / aborted)."""
        self._take_handed()
        prior = self.ended.get(request)
        if prior is not None:
            return BookProblem("ended-twice", request, step,
                               f"request {request} ended twice: {prior[0]} ({prior[2] or 'no reason'}) at step "
                               f"{prior[1]}, then {state} ({reason or 'no reason'}) at step {step}",
                               {"first": prior[0], "first_step": prior[1], "first_reason": prior[2],
                                "second": state, "second_reason": reason})
        self.live.pop(request, None)
        self._unknown.pop(request, None)
        self.ended[request] = (state, step, reason)
        self.ended_count += 1
        if len(self.ended) > self.max_ended:                 # bounded: the oldest ends are forgotten
            for k in list(self.ended)[: self.max_ended // 4]:
                del self.ended[k]
        return None

    # ---- after each step --------------------------------------------------------------------------
    def reconcile(self, step: int, places: dict[str, object]) -> list[BookProblem]:
        """places: place name -> the ids the engine's structures hold there now. The handed-out ids are
        taken first, then compared with the places (read after them: a request handed out before is
        already queued)."""
        self._take_handed()
        self.reconciled += 1
        where: dict[object, list[str]] = {}
        for place, ids in places.items():
            for rid in ids:
                where.setdefault(rid, []).append(place)
        out = []
        for rid, at in where.items():
            if rid in self.live:
                continue
            if rid in self.ended:
                state, at_step, reason = self.ended[rid]
                if ("ended-but-queued", rid) not in self._said:
                    self._said.add(("ended-but-queued", rid))
                    out.append(BookProblem("ended-but-queued", rid, step,
                                           f"request {rid} {state} ({reason or 'no reason'}) at step {at_step} but is "
                                           f"still {' and '.join(at)} at step {step}",
                                           {"places": at, "ended": state, "ended_step": at_step}))
                continue
            n = self._unknown[rid] = self._unknown.get(rid, 0) + 1
            if n > self.grace_steps and ("unknown", rid) not in self._said:
                self._said.add(("unknown", rid))
                out.append(BookProblem("unknown", rid, step,
                                       f"request {rid} is {' and '.join(at)} but was never handed out by the "
                                       f"submission API ({n} steps seen)", {"places": at}))
        for rid in [r for r in self._unknown if r not in where]:
            del self._unknown[rid]
        for rid, (last, last_step) in list(self.live.items()):
            at = where.get(rid)
            if at is None:
                if ("lost", rid) not in self._said:
                    self._said.add(("lost", rid))
                    out.append(BookProblem("lost", rid, step,
                                           f"request {rid} is in no place at step {step}: not queued, waiting, "
                                           f"running nor ended; last seen {last} at step {last_step}",
                                           {"last_place": last, "last_step": last_step}))
                continue
            if len(at) > 1 and ("two-places", rid, tuple(at)) not in self._said:
                self._said.add(("two-places", rid, tuple(at)))
                out.append(BookProblem("two-places", rid, step,
                                       f"request {rid} is in {len(at)} places at step {step}: {', '.join(at)}",
                                       {"places": at, "last_place": last, "last_step": last_step}))
            self.live[rid] = (at[0], step)
        if len(self._said) > 100_000:
            self._said.clear()
        return out

    def counts(self) -> dict:
        places: dict[str, int] = {}
        for place, _ in self.live.values():
            places[place] = places.get(place, 0) + 1
        return {"handed_out": self.handed_out_count, "live": len(self.live), "ended": self.ended_count,
                **{f"live_{k}": v for k, v in sorted(places.items())}}
