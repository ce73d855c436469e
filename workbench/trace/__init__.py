"""Request traces: schema, readers, synthesis, capture, replay, time travel and the pool advisor.

    from workbench.trace import read_trace, replay, TimeTravel, advise, recommend

The modules behind them: readers, schema, synth, capture, simulate (the Simulator), replaying
(replay, ReplayResult), timetravel (TimeTravel, PoolState), advisor (advise, recommend). Each
exported name is the function or class itself, never a module.
"""
import sys as _sys

from .readers import FORMATS, detect_format, read_trace
from .schema import Trace, TraceFormatError, TraceRecord
from .synth import prompt_tokens
from . import replaying as _replaying
from .replaying import ReplayResult, replay, replay_full
from .timetravel import PoolState, TimeTravel
from .advisor import advise, recommend

# The module was called `replay` before the function took the name: `from workbench.trace.replay
# import replay` still resolves (to the replaying module) while `workbench.trace.replay` is the function.
_sys.modules.setdefault(__name__ + ".replay", _replaying)

__all__ = ["FORMATS", "PoolState", "ReplayResult", "TimeTravel", "Trace", "TraceFormatError", "TraceRecord",
           "advise", "detect_format", "prompt_tokens", "read_trace", "recommend", "replay", "replay_full"]
