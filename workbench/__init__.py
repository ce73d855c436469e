"""PagedKV Workbench: an instrumented paged-KV engine, its probes, faults, traces and views."""
from .engine import ConfigError, Engine, EngineConfig, RequestOutput, RequestRejected, SamplingParams

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "EngineConfig", "RequestOutput", "RequestRejected", "SamplingParams"]
