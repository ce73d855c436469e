"""PagedKV Workbench: an instrumented paged-KV engine, its probes, faults, traces and views."""
from .engine import ConfigError, Engine, EngineConfig, RequestOutput, RequestRejected, SamplingParams

from .findings import Finding
from .probe import Probe
from .workbench import Workbench

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "EngineConfig", "Finding", "Probe", "RequestOutput", "RequestRejected",
           "SamplingParams", "Workbench"]
