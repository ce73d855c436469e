"""Finding: what a probe concluded, with the evidence and the fix to try."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warn", "error", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
COLUMNS = ["probe", "kind", "severity", "step", "time", "request_id", "layer", "page", "lock",
           "message", "hint", "evidence"]


@dataclass
class Finding:
    probe: str
    severity: str                      # info | warn | error | critical
    message: str
    hint: str = ""                     # the fix to try
    kind: str = ""                     # a short machine name: stale-binding, probe-error, ...
    step: int | None = None
    request_id: Any = None
    layer: int | None = None
    page: int | None = None
    lock: str | None = None
    evidence: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"severity {self.severity!r} is not one of {SEVERITIES}")

    def at_least(self, severity: str) -> bool:
        return SEVERITY_RANK[self.severity] >= SEVERITY_RANK[severity]

    def to_dict(self) -> dict:
        return asdict(self)


def findings_frame(findings: list[Finding]):
    import pandas as pd
    if not findings:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame([f.to_dict() for f in findings])
    return df[COLUMNS]
