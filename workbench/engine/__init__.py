"""The instrumented paged-KV + packed-sequence engine."""
from .config import ConfigError, EngineConfig
from .engine import Engine
from .outputs import RequestOutput, RequestRejected
from .sequence import SamplingParams

__all__ = ["ConfigError", "Engine", "EngineConfig", "RequestOutput", "RequestRejected", "SamplingParams"]
