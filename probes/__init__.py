"""The probes, one module each; PROBES maps a probe's name to "module:Class".

Modules are imported on first use; a probe whose module fails to import makes attach()
fail with that module's error (ProbeImportError), it is never silently left out.
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
    "attention": "probes.attention_check:AttentionCheckProbe",
    "rank_consistency": "probes.rank_consistency:RankConsistencyProbe",
    "forward_progress": "probes.forward_progress:ForwardProgressProbe",
    "request_lifecycle": "probes.request_lifecycle:RequestLifecycleProbe",
}


class ProbeImportError(ImportError):
    """A probe's module failed to import: attach() says which probe, which module and why."""


def probe_class(name: str):
    if name not in PROBES:
        raise KeyError(f"no probe named {name!r}; probes: {', '.join(PROBES)}")
    mod, cls = PROBES[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        # Loud, never skipped: a broken probe that silently drops out of attach() would leave
        # its invariant unchecked while every report says the run was clean.
        raise ProbeImportError(f"probe {name!r} ({PROBES[name]}) cannot be loaded: {type(e).__name__}: {e}") from e


def available() -> list[str]:
    """Every registered probe's name (Workbench.attach() with no names attaches them all)."""
    return list(PROBES)
