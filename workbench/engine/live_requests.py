"""LiveRequests: the engine's requests by id, from intake to their terminal state.

What abort() can reach: drain_inbox enters each request the scheduler receives, and the step
forgets it when it finishes (or is aborted), so an abort that arrives after the finish names
nothing and is ignored. Only the engine thread touches it.
"""
from __future__ import annotations

from .sequence import Sequence


class LiveRequests:
    # Fault seams: `forget` (a finish that leaves the request reachable, so a late abort finishes it
    # a second time: finish_then_abort).
    FAULT_SEAMS = frozenset({"forget"})

    def __init__(self):
        self._by_id: dict[int, Sequence] = {}

    def enter(self, seq: Sequence) -> None:
        self._by_id[seq.request_id] = seq

    def forget(self, request_id: int) -> Sequence | None:
        """Drop request_id (it finished); the sequence, or None if it was not live."""
        return self._by_id.pop(request_id, None)

    def take(self, request_id) -> Sequence | None:
        """The live sequence an abort names, removed; None when it is unknown or already finished."""
        return self._by_id.pop(request_id, None)
