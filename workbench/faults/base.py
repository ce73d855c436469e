"""Fault: one production failure, reproduced on a live engine and undone on exit.

A fault changes the engine the way the production bug did (a moved call, a missing
refcount, a corrupted tensor, a thread that hammers a lock), so the *symptom* is real:
garbled text, a hang, slower steps, growing memory. It must restore everything in
disable(), so the same engine runs clean afterwards.
"""
from __future__ import annotations

from typing import Any


class Fault:
    name = "fault"
    symptom = ""        # what production saw
    cause = ""          # the root cause, in one sentence
    caught_by = ""      # the probe that names it
    fix = ""            # what fixed it in production / the option that fixes it here
    notebook = ""       # the notebook that walks from symptom to fix

    def __init__(self, engine, **params: Any):
        self.engine = engine
        self.params = params
        self._undo: list = []
        self.enabled = False

    def patch(self, obj: Any, attr: str, value: Any) -> None:
        """Set obj.attr = value, remembering how to put it back. Only a declared seam: the class
        lists what a fault may replace (FAULT_SEAMS, each with its contract), so production code
        names every place a fault can change it and never has to detect a patch."""
        seams = seams_of(obj)
        if attr not in seams:
            raise TypeError(f"{type(self).__name__}: {type(obj).__name__}.{attr} is not a declared fault seam "
                            f"(declared: {sorted(seams) or 'none'}); add it to {type(obj).__name__}.FAULT_SEAMS "
                            "with its contract, or change the engine through its public API")
        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        self._undo.append((obj, attr, old, had))

    def enable(self) -> None:
        self.enabled = True
        self.on_enable()

    def disable(self) -> None:
        try:
            self.on_disable()
        finally:
            for obj, attr, old, had in reversed(self._undo):
                if had:
                    setattr(obj, attr, old)
                else:
                    try:
                        delattr(obj, attr)
                    except AttributeError:
                        setattr(obj, attr, old)
            self._undo.clear()
            self.enabled = False

    def on_enable(self) -> None:
        raise NotImplementedError

    def on_disable(self) -> None:
        pass


def seams_of(obj: Any) -> frozenset:
    """The attributes obj's class (or a base) declares a fault may replace: FAULT_SEAMS."""
    return frozenset().union(*(vars(c).get("FAULT_SEAMS", ()) for c in type(obj).__mro__))


def forget_cached_since(pool, before: dict) -> int:
    """Drop the prefix-cache entries registered since `before` (a copy of pool.cached).

    A fault that garbles attention also garbles the K/V the next layers write, and full
    pages of that K/V get registered in the prefix cache: a later request with the same
    prefix would read them long after the fault is gone (in production: flush the prefix
    cache after the fix). Pages registered before the fault hold K/V written before it.
    The pool reports the dropped hashes as evictions, so time travel stays exact.
    """
    return len(pool.forget([p for h, p in list(pool.cached.items()) if before.get(h) != p]))
