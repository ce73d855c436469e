"""The probes, one module each; PROBES maps a probe's name to "module:Class".

Modules are imported on first use, so one probe's import error cannot hide the others.
"""
from __future__ import annotations

import importlib

PROBES = {
    "page_table": "probes.page_table:PageTableProbe",
    "cu_seqlens": "probes.cu_seqlens:CuSeqlensProbe",
    "fp16_overflow": "probes.fp16_overflow:FP16OverflowProbe",
    "lock_contention": "probes.lock_contention:LockContentionProbe",
    "bandwidth": "probes.bandwidth:BandwidthProbe",
    "leak": "probes.leak:LeakProbe",
    "pool": "probes.pool:PoolProbe",
    "packing": "probes.packing:PackingProbe",
    "pool_accounting": "probes.pool_accounting:PoolAccountingProbe",
    "prefix_cache": "probes.prefix_cache:PrefixCacheProbe",
    "shadow": "probes.shadow:ShadowProbe",
}


def probe_class(name: str):
    if name not in PROBES:
        raise KeyError(f"no probe named {name!r}; probes: {', '.join(PROBES)}")
    mod, cls = PROBES[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def available() -> list[str]:
    """Probes whose module imports."""
    out = []
    for name in PROBES:
        try:
            probe_class(name)
            out.append(name)
        except (ImportError, AttributeError):
            pass
    return out
