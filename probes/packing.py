"""packing: every index tensor of a packed batch against the sequences' own state.

Per forward (vectorised over tokens, read once at layer 0 through a model-hook tap), the
reference is rebuilt from what each sequence itself holds — the tokens it had computed
before the step, the chunk the scheduler gave it (the step's StepRecord, engine.step_record), its page list
and its token ids — never from the builder's outputs:

- positions[t] == computed(seq) + t - start(seq): a RoPE position off by a chunk;
- slot_mapping[t] == page_list[pos // ps] * ps + pos % ps: a K/V write into the wrong slot;
- input_ids[t] == the sequence's token at that position;
- every copy an attention backend plans from equals the reference, each named on its own:
  query_lens_np, diff(cu_seqlens_q_np), cu_seqlens_q_np and the device cu_seqlens_q,
  context_lens_np and the device context_lens, cu_seqlens_k, and torch_npu's cumulative
  actual_seq_lengths / actual_seq_lengths_kv when the backend's plan carries them;
- logits_indices: the last row of every sequence that samples this step;
- the attention backend's plan (probes/plan_check.py): each decode query's row, context
  length and pages, each prefill chunk's span, context, pages and causal mask;
- after the step (StepFinished): each sequence's computed tokens advanced by its chunk.

A finding names the token, the request and the copy that disagrees with the sequence's
state (so a wrong host copy is not blamed on the device tensor, or the reverse).

Cost: a few numpy passes over T tokens and B rows per forward (tens of microseconds at
decode sizes), plus one host read of each index tensor (a device sync off CPU).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from workbench.engine import instrumentation
from workbench.engine.step import record_of
from workbench.engine.taps import ModelTap
from workbench.events import StepFinished
from workbench.probe import Probe
from workbench.step_record import StepRecord, as_numpy

from . import invariants, packing_native
from .invariants import Mismatch, PackingReference
from .plan_check import plan_mismatches

HINTS = {
    "positions": "positions must be each sequence's computed tokens + arange(chunk): check where the builder "
                 "offsets positions (a chunk after a prefix hit or a preemption starts at num_computed_tokens)",
    "slot-mapping": "slot_mapping must be page_list[pos // page_size] * page_size + pos % page_size: the K/V of "
                    "this token is written into another token's (or another request's) slot",
    "input-ids": "the packed token ids are not the sequence's tokens at those positions: check the slice "
                 "token_ids[num_computed : num_computed + chunk] in the builder",
    "lengths": "a length copy disagrees with the sequence's own state: the host copies the backend plans "
               "from (query_lens_np, cu_seqlens_q_np, context_lens_np) must be built from the same lengths "
               "as the device tensors, in the same step, and never edited afterwards",
    "logits-indices": "the sampled rows must be the last token of each sequence that completes its prompt or "
                      "decodes this step: a wrong row samples another token's logits",
    "computed-tokens": "after a step each sequence's num_computed_tokens must advance by exactly the chunk it "
                       "was scheduled; a drift makes the next step's positions and slots wrong",
    "scheduled": "the batch holds a sequence the scheduler did not schedule this step (or lost one it did)",
    "plan": "the attention backend's per-step plan disagrees with the batch: check its plan()/plan_decode() (the "
            "row each decode query reads, its context length, the pages gathered, the causal mask of a chunk "
            "after cached context: bottom-right aligned, key j visible to query i iff j <= context - chunk + i)",
}


def _np(t) -> np.ndarray | None:
    a = as_numpy(t)
    return None if a is None else a.reshape(-1)


_last: list = [None, None]        # (batch, record) of a forward no step recorded: both probes share it


def record_for(engine, batch) -> StepRecord:
    """The StepRecord of the forward in flight: the engine's (made when it packed the batch), or, for
    a forward no step planned (a direct model call), one from the batch's own sequences."""
    rec = getattr(engine, "step_record", None)
    if rec is not None and rec.batch is batch:
        return rec
    if _last[0] is not batch:
        _last[0], _last[1] = batch, record_of(engine.step_count, None, batch, engine.pool.num_pages)
    return _last[1]


def batch_reference(engine, batch) -> tuple[PackingReference, list[Mismatch]]:
    """The reference for this batch from the sequences' state and the scheduler's decision
    (its StepRecord), and the mismatches between that decision and the batch's membership."""
    rec = record_for(engine, batch)
    return invariants.record_reference(rec), invariants.membership_mismatches(rec)


class FirstLayerTap(ModelTap):
    """Model-hook tap: fn(batch) once per forward at layer 0 before attention (the tables and
    index tensors are bound, no page read yet), after_fn(batch) once layer 0's attention ran
    (the backend's plan exists). No hidden state: the model may skip unsampled rows' last layer."""

    def __init__(self, fn, after_fn=None):
        self.fn, self.after_fn = fn, after_fn
        # without after_fn, no call after each layer's attention
        self.needs = frozenset({"kv", "attention_out"} if after_fn is not None else {"kv"})

    def forward_layers(self, batch):
        return (0,)                    # the hooks skip it at every other layer

    def on_kv(self, layer, k, v, batch) -> None:
        if layer == 0:
            self.fn(batch)

    def on_attention_out(self, layer, o, batch) -> None:
        if layer == 0:
            self.after_fn(batch)


class PackingProbe(Probe):
    name = "packing"
    description = "positions, slot_mapping, input ids, host/device length copies vs each sequence's own state"

    def __init__(self, every: int = 1, **params: Any):
        super().__init__(every=every, **params)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.batches_checked = 0
        self._pending = None          # (step, batch, record) of the forward in flight, for the post-step check

    def on_attach(self, engine) -> None:
        self._tap = FirstLayerTap(self.guard(self.check_batch), self.guard(self.check_plan))
        instrumentation.add_tap(engine, self._tap)
        self.listen(StepFinished, self.on_step)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._pending = None

    # ---- per forward ---------------------------------------------------------------
    def check_batch(self, batch) -> None:
        step = self.engine.step_count
        if step % self.every:
            return
        t0 = time.perf_counter_ns()
        self.batches_checked += 1
        rec = record_for(self.engine, batch)
        self._pending = (step, batch, rec)
        found = []
        if not packing_native.batch(rec, batch):        # compiled: nothing below would find anything
            ref = invariants.record_reference(rec)
            # the block table is the page_table probe's (it reads the bound device buffer, names stale binds)
            found = invariants.record_mismatches(rec, skip_kinds=("block_table",))
            found += invariants.maxima_mismatches(batch, ref)
            found += invariants.logits_mismatches(batch, ref)
            for m in found:
                self._report(m, batch, ref, step)
        self.rows.append({"step": step, "seqs": len(batch.seqs), "tokens": int(sum(rec.scheduled.tolist())),
                          "mismatches": len(found), "check_us": (time.perf_counter_ns() - t0) / 1e3})
        if len(self.rows) > 100_000:
            del self.rows[:50_000]

    def check_plan(self, batch) -> None:
        """The backend's plan (decode rows, lengths, pages, masks, prefill spans) and torch_npu's
        cumulative lengths when the plan carries them (the NPU path), against the reference."""
        plan = getattr(batch, "attn_plan", None)
        step = self.engine.step_count
        if plan is None or step % self.every:
            return
        npu = hasattr(plan, "actual_seq_lengths") or hasattr(plan, "actual_seq_lengths_kv")
        if not npu and packing_native.plan(record_for(self.engine, batch), plan):   # compiled: a clean decode plan
            return
        ref, _ = batch_reference(self.engine, batch)
        found = plan_mismatches(plan, ref)
        if npu:
            found += invariants.packing_mismatches(ref, twins={
                "actual_seq_lengths": (_np(getattr(plan, "actual_seq_lengths", None)), "ends_q"),
                "actual_seq_lengths_kv": (_np(getattr(plan, "actual_seq_lengths_kv", None)), "ends_k")})
        for m in found:
            self._report(m, batch, ref, step)

    # ---- after the step ------------------------------------------------------------
    def on_step(self, e: StepFinished) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != e.step:
            return
        _, batch, rec = pending
        for i, (s, want) in enumerate(zip(batch.seqs, (rec.computed + rec.scheduled).tolist())):
            # a sequence preempted or aborted after the forward restarts from 0: not a drift
            if s.num_computed_tokens != want and s.num_computed_tokens != 0 and s.pages:
                self._report(Mismatch("computed-tokens", "num_computed_tokens", i, -1, s.num_computed_tokens,
                                      want), batch, invariants.record_reference(rec), e.step)

    # ---- findings ------------------------------------------------------------------
    def _report(self, m: Mismatch, batch, ref: PackingReference, step: int) -> None:
        seq = batch.seqs[m.row] if 0 <= m.row < len(batch.seqs) else None
        rid = seq.request_id if seq is not None else None
        who = f"request {rid}" if seq is not None else "the batch"
        page = None
        ev = {"check": m.check, "copy": m.copy, "row": m.row, "index": m.index, "got": m.got, "want": m.want}
        if m.check in ("positions", "slot-mapping", "input-ids") and m.index >= 0 and seq is not None:
            pos = int(ref.positions[m.index])
            page = int(seq.pages[pos // ref.page_size]) if pos // ref.page_size < len(seq.pages) else None
            ev.update(token=m.index, position=pos, page=page)
            what = {"positions": "position", "slot-mapping": "slot", "input-ids": "token id"}[m.check]
            msg = (f"{who}: packed token {m.index} (its position {pos}, page {page}) has {what} {m.got} in "
                   f"{m.copy}, the sequence's own state says {m.want}")
        elif m.check == "block-table":
            msg = f"{who}: {m.copy} column {m.index} holds {m.got}, the page list says {m.want}"
        elif m.check == "plan":
            what = m.copy.split(".")[-1]
            msg = (f"{who}: the attention plan's {m.copy} is {m.got} at {'token' if what in ('tok', 'rows', 'lens', 'span', 'start', 'context', 'mask') else 'column'} "
                   f"{m.index}, the sequence's own state says {m.want}: every layer reads through this plan")
            ev.update(plan_entry=m.copy)
        elif m.check == "computed-tokens":
            msg = (f"{who}: after the step it has {m.got} computed tokens, it was {int(ref.starts[m.row])} + a chunk "
                   f"of {int(ref.q_lens[m.row])} = {m.want}")
        elif m.check == "scheduled":
            msg = (f"the batch holds request {m.got} (row {m.row}), which the scheduler did not schedule this step"
                   if m.got is not None else f"the scheduler scheduled a sequence ({m.want} tokens) the batch lacks")
            rid = m.got
        elif m.row >= 0 and seq is not None and m.index >= 0:
            msg = (f"{who}: {m.copy}[{m.index}] is {m.got}, the sequence's own state says {m.want} (it had "
                   f"{int(ref.starts[m.row])} tokens computed and was scheduled {int(ref.q_lens[m.row])}); the "
                   f"other copies of this length agree with it" if m.check == "lengths" else
                   f"{who}: {m.copy}[{m.index}] is {m.got}, the reference says {m.want}")
        else:
            msg = f"{m.copy}: {m.got} where the sequences' state gives {m.want}"
        self.report("error", msg, hint=HINTS.get(m.check, HINTS["lengths"]), kind=f"packing-{m.check}",
                    dedup=(m.check, m.copy, rid, m.index if m.check not in ("lengths", "computed-tokens") else None),
                    step=step, request_id=rid, page=page, evidence=ev)

    def frame(self):
        """One row per checked forward: sequences, tokens, mismatches found, the check's cost."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=["step", "seqs", "tokens", "mismatches", "check_us"])
