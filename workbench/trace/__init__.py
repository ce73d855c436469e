"""Request traces: schema, readers, synthesis (capture and replay build on these)."""
from .readers import FORMATS, detect_format, read_trace
from .schema import Trace, TraceFormatError, TraceRecord
from .synth import prompt_tokens

__all__ = ["FORMATS", "Trace", "TraceFormatError", "TraceRecord", "detect_format", "prompt_tokens", "read_trace"]
