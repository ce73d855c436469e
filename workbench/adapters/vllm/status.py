"""What the plugin checks in this process, said once at start-up and kept for the workbench.

One CheckStatus per check (and per KV cache group where a group is not checked): active or
not, through which hook, on which path. Each is one line in vLLM's log
(`vllm_pool: active via Scheduler.update_from_output (batch queue, size 2)`), is sent to the
workbench as a `status` message (kvwb_vllm_check_active{check=...}, `kvwb vllm status`, the
watch widget), and is resent every few seconds so a workbench that attaches late learns it.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

# a child of vLLM's logger: its handler and format, in every vLLM process
log = logging.getLogger("vllm.pagedkv_workbench")

CHECK_POOL = "vllm_pool"
CHECK_METADATA = "vllm_metadata"
CHECK_FAULTS = "faults"


@dataclass
class CheckStatus:
    check: str
    active: bool
    via: str = ""          # the hook: Scheduler.update_from_output, AttentionMetadataBuilder.build, ...
    path: str = ""         # the path it sits on: synchronous step / batch queue, the model runner
    reason: str = ""       # why not active, or what is left out

    def line(self) -> str:
        if self.active:
            s = f"{self.check}: active via {self.via}" + (f" ({self.path})" if self.path else "")
            return s + (f"; {self.reason}" if self.reason else "")
        return f"{self.check}: NOT active" + (f" ({self.path})" if self.path else "") + f": {self.reason}"

    def as_dict(self) -> dict:
        return asdict(self)


def say(status: CheckStatus) -> None:
    (log.info if status.active else log.warning)("PagedKV Workbench plugin: %s", status.line())


def problem(message: str) -> None:
    """Something of ours went wrong; vLLM goes on. One line, naming the cause."""
    log.warning("PagedKV Workbench plugin: %s", message)
