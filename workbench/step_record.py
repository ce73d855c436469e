"""StepRecord: what one step ran, in the one shape probes read, whoever ran it.

Two producers:
  - our engine (engine/step.py), once the batch is packed and before the forward, so that
    probes reading it during the forward (layer 0 taps) and after it (StepFinished) see the
    same record; timings and pool counters are added when the step ends;
  - the vLLM plugin's worker side (adapters/vllm/worker_side.py), from the attention
    metadata a builder produced and the workbench's own ledger of the SchedulerOutputs.
One consumer contract: probes/invariants.record_mismatches(record) checks every copy
against the reference, for both (the packing probe in our engine, the sanitizer in vLLM).

A record has two halves, kept apart on purpose:
  - the reference: what the scheduler decided (each row's tokens this step) and what each
    request itself holds (the tokens it had computed before the step, its own page list, its
    token ids), never read back from the batch;
  - the copies: what the kernels are handed, by name, each with the kind of thing it must
    equal (COPY_KINDS). Tensors stay tensors until a probe asks (array()): a record costs
    the step a few list reads when nobody looks. They are the batch builder's buffers,
    reused by the next step: a record kept past its step is frozen first (freeze()).
Our engine's record also carries its device-side objects (batch, schedule, plan) for the
probes that read the device buffers themselves; a vLLM record leaves them None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

# What a copy must equal, from the reference: per-row query lengths ("q"), cumulative ones
# from 0 ("cu_q", cu_seqlens / query_start_loc), context lengths ("ctx", seq_lens), their
# cumulative ("cu_k"), torch_npu's cumulative lengths without the leading 0 ("ends_q",
# "ends_k"), a cu_seqlens whose differences are the query lengths ("diff_q"), the block table
# [B, W] ("block_table"), and the per-token "positions", "slot_mapping" and "input_ids".
COPY_KINDS = frozenset({"q", "cu_q", "ctx", "cu_k", "ends_q", "ends_k", "diff_q", "block_table", "positions",
                        "slot_mapping", "input_ids"})
SOURCES = ("engine", "vllm")


def as_numpy(t) -> np.ndarray | None:
    """A tensor or array-like as int64 numpy (a device tensor is read back to the host once)."""
    if t is None:
        return None
    if hasattr(t, "detach"):
        t = t.detach().to("cpu").numpy()
    return np.asarray(t).astype(np.int64, copy=False)


@dataclass(eq=False)
class StepRecord:
    step: int                        # the engine's step (vLLM: the worker's execution count)
    source: str                      # "engine" or "vllm"
    page_size: int
    num_pages: int | None            # pool size: ids outside [0, num_pages) are out of range
    # ---- the reference: one entry per row, in the batch's row order
    request_ids: list
    computed: np.ndarray             # [B] tokens each request had computed before the step
    scheduled: np.ndarray            # [B] tokens the scheduler gave it this step
    pages: list[list[int]]           # each request's own page list (a copy, as it stood at prepare)
    token_ids: Sequence | None = None   # each request's token ids (engine; prefixes never change)
    # ---- the copies: name -> (kind, tensor or array), what the kernels are handed
    copies: dict = field(default_factory=dict)
    # rows the batch holds that the scheduler did not schedule / scheduled requests it lacks
    unscheduled: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    # ---- our engine only: the objects behind the copies (None from vLLM)
    batch: Any = None                # PackedBatch: the device tensors, attn_plan once planned
    schedule: Any = None             # SchedulerOutput
    # ---- filled when the step ends: ns per phase, pool counters before / after
    timings: dict = field(default_factory=dict)
    pool: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"StepRecord.source must be one of {SOURCES}, got {self.source!r}")
        bad = {k: kind for k, (kind, _) in self.copies.items() if kind not in COPY_KINDS}
        if bad:
            raise ValueError(f"StepRecord copies of unknown kind: {bad} (kinds: {sorted(COPY_KINDS)})")
        self.computed = np.asarray(self.computed, dtype=np.int64)
        self.scheduled = np.asarray(self.scheduled, dtype=np.int64)
        n = len(self.request_ids)
        if not (len(self.computed) == len(self.scheduled) == len(self.pages) == n):
            raise ValueError(f"StepRecord rows disagree: {n} request ids, {len(self.computed)} computed, "
                             f"{len(self.scheduled)} scheduled, {len(self.pages)} page lists")
        self._arrays: dict = {}

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.scheduled))

    @property
    def plan(self):
        """The attention backend's plan for this step (our engine, once layer 0 planned it)."""
        return getattr(self.batch, "attn_plan", None)

    def array(self, name: str) -> np.ndarray | None:
        """The copy `name` as int64 numpy, read once per record (a device tensor: one host read)."""
        if name not in self._arrays:
            self._arrays[name] = as_numpy(self.copies[name][1]) if name in self.copies else None
        return self._arrays[name]

    def freeze(self) -> "StepRecord":
        """Copy every copy to the host now and keep it: a record's tensors are the builder's reused
        buffers, rewritten when the next step packs, so a record kept past its step is frozen first.
        The step's own objects (batch, schedule: the sequences, the attention plan) are let go, so
        kept records hold no step alive (a leak probe would see them). Returns self."""
        for name in self.copies:
            a = self.array(name)
            self._arrays[name] = None if a is None else np.array(a, copy=True)
        self.token_ids = None if self.token_ids is None else [list(t[:c + n]) for t, c, n in
                                                                zip(self.token_ids, self.computed, self.scheduled)]
        self.batch = self.schedule = None
        self.copies = {name: (kind, self._arrays[name]) for name, (kind, _) in self.copies.items()}
        return self

    def frame(self):
        """One row per request: what it had computed, what it ran, its pages (a pandas DataFrame)."""
        import pandas as pd
        return pd.DataFrame({"step": self.step, "request_id": self.request_ids,
                             "computed": self.computed, "scheduled": self.scheduled,
                             "num_pages": [len(p) for p in self.pages],
                             "pages": [list(p) for p in self.pages]})

    def summary(self) -> dict:
        """The step in one row: sizes, timings and pool counters (for a frame of many steps)."""
        return {"step": self.step, "source": self.source, "rows": self.num_rows, "tokens": self.num_tokens,
                **{f"{k}_ns": v for k, v in self.timings.items()}, **self.pool}
