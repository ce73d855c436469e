"""Divergence triage (issue 29): "the output changed" -> which request and token, drift or corruption.

    from workbench.diverge import triage
    report = triage(engine_a, engine_b_or_hf_dir, prompts, max_tokens=32)
    report.frame()          # request, verdict (identical | drift | corruption), first_token, layer, pages, evidence
"""
from .sides import EngineSide, HFSide, RecordingSide, Run, VllmSide
from .triage import TriageReport, triage

__all__ = ["EngineSide", "HFSide", "RecordingSide", "Run", "TriageReport", "VllmSide", "triage"]
