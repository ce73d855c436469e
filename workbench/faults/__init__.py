"""The fault catalogue: each production failure, switchable on a live engine.

    from workbench import faults
    with faults.inject(engine, "stale_binding"):
        engine.generate(...)
    faults.catalogue()          # DataFrame: fault, symptom, cause, caught_by, fix

Each fault lives in its own module as a Fault subclass; FAULTS maps its name to
"module:Class" and modules are imported on first use.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Iterator

from .base import Fault

FAULTS = {
    "stale_binding": "workbench.faults.stale_binding:StaleBinding",
    "page_out_of_range": "workbench.faults.page_out_of_range:PageOutOfRange",
    "free_while_shared": "workbench.faults.free_while_shared:FreeWhileShared",
    "cu_seqlens_corrupt": "workbench.faults.cu_seqlens_corrupt:CuSeqlensCorrupt",
    "fp16_kv_overflow": "workbench.faults.fp16_kv_overflow:FP16KVOverflow",
    "lock_storm": "workbench.faults.lock_storm:LockStorm",
    "lock_inversion": "workbench.faults.lock_inversion:LockInversion",
    "buffer_leak": "workbench.faults.buffer_leak:BufferLeak",
    "slow_page_size": "workbench.faults.slow_page_size:SlowPageSize",
    "rank_desync": "workbench.faults.rank_desync:RankDesync",
    "pool_pressure": "workbench.faults.pool_pressure:PoolPressure",
    "admission_refuses_long_prompts": "workbench.faults.admission_refused:AdmissionRefused",
    "intake_loses_request": "workbench.faults.intake_loses_request:IntakeLosesRequest",
    "finish_then_abort": "workbench.faults.finish_then_abort:FinishThenAbort",
    "abort_leaves_waiting": "workbench.faults.abort_leaves_waiting:AbortLeavesWaiting",
    "eviction_keeps_index_entry": "workbench.faults.eviction_keeps_index_entry:EvictionKeepsIndexEntry",
    "write_into_cached_page": "workbench.faults.write_into_cached_page:WriteIntoCachedPage",
}


def fault_class(name: str) -> type[Fault]:
    if name not in FAULTS:
        raise KeyError(f"no fault named {name!r}; faults: {', '.join(FAULTS)}")
    mod, cls = FAULTS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def make(engine, name: str, **params: Any) -> Fault:
    """The fault `name` on engine with its parameters; a parameter it does not take is a TypeError
    naming the ones it does (a typo must not silently run the default)."""
    cls = fault_class(name)
    sig = inspect.signature(cls)
    try:
        sig.bind(engine, **params)
    except TypeError:
        known = [p for p in sig.parameters if p != "engine"]
        bad = sorted(set(params) - set(known))
        raise TypeError(f"fault {name!r} has no parameter {', '.join(map(repr, bad))}; it takes "
                        f"{', '.join(known) or 'no parameters'}") from None
    return cls(engine, **params)


@contextlib.contextmanager
def inject(engine, name: str, **params: Any) -> Iterator[Fault]:
    """Switch a fault on for the duration of the with-block; it is undone on exit, even on error."""
    fault = make(engine, name, **params)
    fault.enable()
    try:
        yield fault
    finally:
        fault.disable()


def catalogue():
    """Every fault with what production saw, the cause, the probe that catches it and the fix."""
    import pandas as pd
    rows = []
    for name in FAULTS:
        try:
            c = fault_class(name)
        except (ImportError, AttributeError) as e:
            rows.append({"fault": name, "symptom": f"(not available: {e})", "cause": "", "caught_by": "",
                         "fix": "", "notebook": ""})
            continue
        rows.append({"fault": name, "symptom": c.symptom, "cause": c.cause, "caught_by": c.caught_by,
                     "fix": c.fix, "notebook": c.notebook})
    return pd.DataFrame(rows)


__all__ = ["FAULTS", "Fault", "catalogue", "fault_class", "inject", "make"]
