"""PagedKV Workbench: an instrumented paged-KV engine, its probes, faults, traces and views.

The names below are imported on first use (PEP 562), not with the package: the vLLM plugin
(workbench.adapters.vllm.plugin) is loaded inside vLLM's own environment, where only
numpy, torch and ZMQ can be counted on, and must not pull in the engine's loaders or the views.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "workbench.engine",
    "Engine": "workbench.engine",
    "EngineConfig": "workbench.engine",
    "RequestOutput": "workbench.engine",
    "RequestRejected": "workbench.engine",
    "SamplingParams": "workbench.engine",
    "Finding": "workbench.findings",
    "Probe": "workbench.probe",
    "Workbench": "workbench.workbench",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value                  # once: later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
