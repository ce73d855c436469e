"""cu_seqlens: checks the cumulative sequence lengths a varlen kernel trusts blindly.

Field note 4: cu_seqlens_q / _k must be int32, contiguous, on the query's device,
[B+1] long, start at 0, increase (strictly: no scheduled sequence is empty), end at the
token total, and agree with max_seqlen. FlashAttention checks only dtype and device,
FlashInfer and the Ascend ops nothing, so a wrong entry silently makes attention cover
the wrong span. The checks are plain functions (check_cu_seqlens, and
check_actual_seq_lengths for torch_npu's cumulative lengths without the leading 0),
so a test or a notebook can run them on any tensor; the probe runs them on every
BatchPacked event (or every `every`-th step). On the NPU path (attention/npu.py) the ops do
not take cu_seqlens: the probe also reads, at layer 0 of the forward, the lists the plan hands
npu_fused_infer_attention_score (actual_seq_lengths, cumulative, for the batch and the
prefill call of a mixed step; actual_seq_lengths_kv, one context length per sequence) and
checks them against the scheduler's lengths of that step's BatchPacked.

Cost: one [B+1] host read per tensor per checked step (a device sync off CPU; raise
`every` to sample) and a few numpy ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Sequence

import numpy as np
import torch

from workbench.engine import instrumentation
from workbench.events import BatchPacked
from workbench.probe import Probe

from .packing import FirstLayerTap

RULES = ("dtype", "contiguous", "device", "length", "start", "decreasing", "empty", "total", "segment",
         "max_seqlen")

HINTS = {
    "dtype": "build cu_seqlens as int32 (the kernels reinterpret the bytes of any other dtype)",
    "contiguous": "pass a contiguous tensor (slice a preallocated buffer, do not stride it)",
    "device": "copy cu_seqlens to the query's device before the launch (the kernel reads device memory)",
    "length": "cu_seqlens must have one entry per sequence plus the leading 0 (B+1): a sequence was "
              "dropped from or added to the batch after packing",
    "start": "cu_seqlens must start at 0 (torch_npu's actual_seq_lengths are the same list without it)",
    "decreasing": "cu_seqlens must be non-decreasing: entries were swapped or overwritten after packing; "
                  "build it once with a cumsum of the query lengths and do not touch it afterwards",
    "empty": "a scheduled sequence got an empty span: its boundary was overwritten, or the scheduler "
             "packed a sequence with no tokens",
    "total": "the last entry must equal the token count of the packed batch: the trailing total was "
             "dropped or the buffer was not refilled this step",
    "segment": "a span disagrees with the scheduled length: the boundaries were computed from other "
               "lengths than the ones packed (check the order of sequences in the batch)",
    "max_seqlen": "max_seqlen must equal the longest span: kernels size their tiles from it and skip "
                  "the rest",
}


@dataclass(frozen=True)
class Violation:
    rule: str         # one of RULES
    index: int        # the first bad segment (sequence index in the batch); -1: the tensor as a whole
    message: str


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _values(t: Any) -> np.ndarray | None:
    """The entries as int64 on the host; None when they cannot be read (a meta tensor)."""
    if isinstance(t, torch.Tensor):
        if t.device.type == "meta":
            return None
        if t.device.type != "cpu":
            t = t.detach().cpu()
        return t.detach().numpy().astype(np.int64).reshape(-1)
    return np.asarray(t, dtype=np.int64).reshape(-1)


def _check_values(cu: np.ndarray, total: int, name: str, lengths: Sequence[int] | None,
                  max_seqlen: int | None, allow_empty: bool, offset: int) -> list[Violation]:
    """Rules on the values of cu (with its leading 0). offset: 1 when the caller's tensor lacks
    the leading 0 (messages then index the caller's entries)."""
    out = []
    at = lambda j: f"{name}[{j - offset}]" if j >= offset else "the implicit leading 0"
    if len(cu) < 2:
        return out
    d = np.diff(cu)
    if lengths is not None and len(lengths) == len(d):
        # The common case, in four operations (a probe runs this every step): spans equal to the
        # scheduled lengths, all positive, ending at the total, the longest as the kernel is told.
        # Then no rule below can fire (no span is negative, empty or off), so the answer is the same.
        want = np.asarray(lengths, dtype=np.int64)
        if (cu[-1] == total and np.array_equal(d, want) and want.min() > 0
                and (max_seqlen is None or want.max() == max_seqlen)):
            return out
    neg = np.nonzero(d < 0)[0]
    if len(neg):
        i = int(neg[0])
        out.append(Violation("decreasing", i, f"{at(i + 1)}={cu[i + 1]} < {at(i)}={cu[i]}: "
                                              f"sequence {i} has a negative span"))
    if not allow_empty:
        zero = np.nonzero(d == 0)[0]
        if len(zero):
            i = int(zero[0])
            out.append(Violation("empty", i, f"{at(i + 1)} == {at(i)} == {cu[i]}: sequence {i} has an empty "
                                             f"span (cu_seqlens must increase strictly when no sequence is empty)"))
    if cu[-1] != total:
        out.append(Violation("total", len(d) - 1, f"{at(len(cu) - 1)}={cu[-1]}, the token total is {total}"))
    if lengths is not None and len(lengths) == len(d):
        want = np.asarray(lengths, dtype=np.int64)
        wrong = np.nonzero(d != want)[0]
        if len(wrong):
            i = int(wrong[0])
            out.append(Violation("segment", i, f"sequence {i} spans {d[i]} tokens ({at(i)}={cu[i]}.."
                                               f"{at(i + 1)}={cu[i + 1]}), it was scheduled {want[i]}"))
    if max_seqlen is not None and d.max() != max_seqlen:
        over = np.nonzero(d > max_seqlen)[0]
        i = int(over[0]) if len(over) else (int(np.argmax(lengths)) if lengths is not None and len(lengths)
                                            else -1)
        out.append(Violation("max_seqlen", i, f"max_seqlen={max_seqlen} but the longest span of {name} is "
                                              f"{d.max()}"))
    return out


def check_cu_seqlens(t: Any, total: int, *, num_seqs: int | None = None, lengths: Sequence[int] | None = None,
                     max_seqlen: int | None = None, device: torch.device | str | None = None,
                     allow_empty: bool = False, name: str = "cu_seqlens") -> list[Violation]:
    """Every rule cu_seqlens (t: [B+1]) breaks, each with its first bad segment.

    total: the packed token count (last entry); num_seqs: B; lengths: the scheduled span of
    each sequence; max_seqlen: what the kernel is told; device: the query's device.
    """
    out = []
    if isinstance(t, torch.Tensor):
        if t.dtype != torch.int32:
            out.append(Violation("dtype", -1, f"{name} is {t.dtype}, kernels read int32"))
        if not t.is_contiguous():
            out.append(Violation("contiguous", -1, f"{name} is not contiguous (stride {t.stride()})"))
        if device is not None and not _same_device(t.device, device):
            out.append(Violation("device", -1, f"{name} is on {t.device}, the query on {torch.device(device)}"))
    cu = _values(t)
    if cu is None:
        return out
    if num_seqs is not None and len(cu) != num_seqs + 1:
        out.append(Violation("length", min(len(cu), num_seqs + 1) - 1,
                             f"{name} has {len(cu)} entries, a batch of {num_seqs} sequences needs {num_seqs + 1}"))
    if len(cu) == 0:
        return out
    if cu[0] != 0:
        out.append(Violation("start", 0, f"{name}[0]={cu[0]}, it must start at 0"))
    out += _check_values(cu, total, name, lengths, max_seqlen, allow_empty, offset=0)
    return sorted(out, key=lambda v: (v.index, RULES.index(v.rule)))


def plainly_clean(t: Any, lengths: Sequence[int], *, num_seqs: int, max_seqlen: int | None,
                  device: torch.device | str | None = None) -> bool:
    """True where check_cu_seqlens(t, sum(lengths), num_seqs=..., lengths=..., max_seqlen=..., device=...)
    finds nothing, decided in a few Python operations (the probe asks twice a step, at the engine's
    pace: ~30 small numpy operations otherwise, ~0.1 ms a step); False where it must look (it may then
    find nothing: a host tensor on another device kind, say)."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()):
        return False
    if device is not None and torch.device(device).type != "cpu":
        return False
    lengths = list(lengths)
    if len(lengths) != num_seqs or not lengths or min(lengths) <= 0:
        return False
    if max_seqlen is not None and max(lengths) != max_seqlen:
        return False
    return t.tolist() == list(accumulate(lengths, initial=0))


def check_actual_seq_lengths(t: Any, total: int, *, num_seqs: int | None = None,
                             lengths: Sequence[int] | None = None, max_seqlen: int | None = None,
                             allow_empty: bool = False, name: str = "actual_seq_lengths") -> list[Violation]:
    """The same rules for torch_npu's TND `actual_seq_lengths`: cumulative ends of each sequence,
    i.e. cu_seqlens without the leading 0 ([B] entries; a list or an int32/int64 tensor)."""
    v = _values(t)
    if v is None:
        return []
    out = []
    if num_seqs is not None and len(v) != num_seqs:
        out.append(Violation("length", min(len(v), num_seqs) - 1,
                             f"{name} has {len(v)} entries, a batch of {num_seqs} sequences needs {num_seqs}"))
    if len(v):
        cu = np.concatenate([[0], v])
        out += _check_values(cu, total, name, lengths, max_seqlen, allow_empty, offset=1)
    return sorted(out, key=lambda x: (x.index, RULES.index(x.rule)))


def check_seq_lengths_kv(t: Any, lengths: Sequence[int], name: str = "actual_seq_lengths_kv") -> list[Violation]:
    """torch_npu's paged TND `actual_seq_lengths_kv`: one context length per sequence (not cumulative,
    as vllm-ascend passes them with a block table), each equal to the scheduled context."""
    v = _values(t)
    if v is None:
        return []
    want = np.asarray(lengths, dtype=np.int64)
    if len(v) != len(want):
        return [Violation("length", min(len(v), len(want)) - 1,
                          f"{name} has {len(v)} entries, a batch of {len(want)} sequences needs {len(want)}")]
    bad = np.nonzero(v != want)[0]
    return [Violation("segment", int(i), f"{name}[{i}]={v[i]}, the sequence's context is {want[i]} tokens")
            for i in bad[:8]]


def _in_batch(v: Violation, rows: list[int]) -> Violation:
    """A violation of a call's own list (the prefill rows of a mixed step), indexed by batch row."""
    if 0 <= v.index < len(rows) and rows != list(range(len(rows))):
        return Violation(v.rule, rows[v.index], v.message)
    return v


class CuSeqlensProbe(Probe):
    name = "cu_seqlens"
    description = "cu_seqlens_q / _k of every packed batch: int32, contiguous, device, B+1, 0..total, monotone"

    def __init__(self, every: int = 1, **params: Any):
        super().__init__(every=every, **params)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.batches_checked = 0

    def on_attach(self, engine) -> None:
        self.listen(BatchPacked, self.on_batch)
        self._packed = None
        # torch_npu's ops take the lengths from the attention plan, not from cu_seqlens: read
        # what the plan hands them (layer 0, before any attention runs). Other backends' kernels
        # read cu_seqlens itself: no model hook for them (a tap wires a call into every layer).
        self._tap = FirstLayerTap(self.guard(self.on_plan))
        if getattr(engine.attn, "name", None) == "npu":
            instrumentation.add_tap(engine, self._tap)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._packed = None

    def on_plan(self, batch) -> None:
        """The cumulative lengths the NPU ops get (NpuPlan: actual_seq_lengths for the batch and the
        prefill call's own, actual_seq_lengths_kv per sequence), against the scheduler's lengths
        of this step's BatchPacked."""
        plan, e = getattr(batch, "attn_plan", None), self._packed
        if plan is None or not hasattr(plan, "actual_seq_lengths") or e is None or e.step != self.engine.step_count:
            return
        if e.step % self.every:
            return
        q, ctx, n = list(e.query_lens), list(e.context_lens), len(e.request_ids)
        # (name, cumulative ends, kv lengths, the batch rows the call covers)
        checks = [("actual_seq_lengths", plan.actual_seq_lengths, plan.actual_seq_lengths_kv, list(range(n)))]
        rows = getattr(plan, "prefill_rows", None)
        if getattr(plan, "prefill_seq_lengths", None) is not None and rows is not None and len(rows) < n:
            checks.append(("prefill actual_seq_lengths", plan.prefill_seq_lengths, plan.prefill_seq_lengths_kv,
                           [int(r) for r in rows]))       # the prefill call of a mixed step: its own rows
        for name, ends, kv, rows in checks:
            lengths, kv_lengths = [q[r] for r in rows], [ctx[r] for r in rows]
            kv_name = name.replace("actual_seq_lengths", "actual_seq_lengths_kv")
            for v in check_actual_seq_lengths(ends, int(sum(lengths)), num_seqs=len(rows), lengths=lengths, name=name):
                self._report(e, name, ends, lengths, _in_batch(v, rows))
            for v in check_seq_lengths_kv(kv, kv_lengths, name=kv_name):
                self._report(e, kv_name, kv, kv_lengths, _in_batch(v, rows))

    def on_batch(self, e: BatchPacked) -> None:
        self._packed = e
        if e.step % self.every:
            return
        self.batches_checked += 1
        rids = e.request_ids
        n = len(rids)
        device = getattr(self.engine, "device", None)
        for name, t, lengths, mx in (("cu_seqlens_q", e.cu_seqlens_q, e.query_lens, e.max_seqlen_q),
                                     ("cu_seqlens_k", e.cu_seqlens_k, e.context_lens, e.max_seqlen_k)):
            if t is None or plainly_clean(t, lengths, num_seqs=n, max_seqlen=mx, device=device):
                continue
            found = check_cu_seqlens(t, int(sum(lengths)), num_seqs=n, lengths=lengths, max_seqlen=mx,
                                     device=device, name=name)
            for v in found:
                self._report(e, name, t, lengths, v)

    def _report(self, e: BatchPacked, name: str, t, lengths, v: Violation) -> None:
        rid = e.request_ids[v.index] if 0 <= v.index < len(e.request_ids) else None
        vals = _values(t)
        self.rows.append({"step": e.step, "tensor": name, "rule": v.rule, "index": v.index, "request_id": rid})
        where = f"batch index {v.index}, request {rid}" if v.index >= 0 else "the whole tensor"
        self.report(
            "error", f"{name} breaks '{v.rule}' at {where}: {v.message}", hint=HINTS[v.rule],
            kind=f"cu-seqlens-{v.rule}", dedup=(name, v.rule, rid), step=e.step, request_id=rid,
            evidence={"tensor": name, "rule": v.rule, "index": v.index,
                      "values": None if vals is None else vals[:65].tolist(),
                      "lengths": list(lengths)[:64], "request_ids": list(e.request_ids)[:64],
                      "dtype": str(getattr(t, "dtype", "")), "device": str(getattr(t, "device", ""))})
