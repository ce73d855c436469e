"""The packing probe's checks compiled (csrc/packing.c): their clean paths; the numpy checks
(invariants.record_mismatches, plan_check.plan_mismatches) are the reference, and the ones that report.

At layer 0 of every forward the packing probe compares every index copy of the batch (positions,
slot_mapping, input_ids, each host and device length copy, the maxima, the sampled rows) with the
batch as the sequences mean it, and, once layer 0 has planned it, the attention plan. In numpy that is
a reference of ~15 operations and ~4 more per copy, each a cold dispatch between the layer's kernels
(~0.4 ms a forward on SmolLM2's workload A); the C twin walks the rows once and builds nothing. It says
clean (True) or look (False); on look the numpy checks run and name every finding, so the findings are
the numpy code's. The decode plan is compiled for a step of decode rows only (the compiled decode
kernel's plan); a step with prefill rows is judged in numpy.

Tried once per process (`trial`) against the numpy verdicts: a clean mixed batch, then each kind of
mismatch planted in it. Not available (no C compiler, PAGEDKV_PROBE_KERNELS=numpy,
PAGEDKV_CPU_FEATURES=none, a failed trial): the numpy checks run every time, as before.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from workbench.engine.kernels import Kernel, Spec

CSRC = Path(__file__).with_name("csrc")
CHECK = Kernel(Spec("pagedkv_packing_check", (CSRC / "packing.c",), "compiled packing checks", kind="c",
                    flags=("-O2",), headers=(CSRC / "buffers.h",), switch=("PAGEDKV_PROBE_KERNELS", "numpy")),
               fallback="the numpy checks (probes/invariants.py, probes/plan_check.py)",
               trial="probes.packing_native:trial")

# a copy's kind (StepRecord.COPY_KINDS, less the block table: the page_table probe's) -> packing.c's code
KINDS = {"positions": 0, "slot_mapping": 1, "input_ids": 2, "q": 3, "diff_q": 4, "cu_q": 5, "ctx": 6, "cu_k": 7,
         "ends_q": 8, "ends_k": 9}


def _ints(t) -> np.ndarray:
    """A tensor's or array's values as a flat numpy view where it is on the CPU (int32 or int64 kept)."""
    a = t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)
    return a.reshape(-1)


def batch(rec, b) -> bool:
    """True where the numpy batch check (membership, every copy but the block table, the maxima, the
    sampled rows) would find nothing in record `rec` of batch `b`; False where it must look."""
    mod = CHECK.get()
    if mod is None or rec.unscheduled or rec.missing:
        return False
    try:
        return mod.batch(*_batch_args(rec, b))
    except (TypeError, BufferError, ValueError, KeyError, AttributeError, OverflowError):
        return False                          # arrays of another layout or a record of another shape: numpy reads it


def _batch_args(rec, b) -> tuple:
    """packing.c batch()'s arguments from a StepRecord and its batch: every copy but the block table (the
    page_table probe's), the maxima, the sampled rows and each row's whole token count."""
    copies = [(KINDS[kind], got) for name, (kind, _) in rec.copies.items() if kind != "block_table"
              for got in (rec.array(name),) if got is not None]
    totals = np.fromiter((s.num_tokens for s in b.seqs), dtype=np.int64, count=len(b.seqs))
    return (rec.computed, rec.scheduled, rec.pages, rec.token_ids, rec.page_size, copies, int(b.max_seqlen_q),
            int(b.max_seqlen_k), _ints(b.logits_indices), totals)


def plan(rec, p) -> bool:
    """True where plan_mismatches would find nothing in plan `p`: a plan of one compiled decode group and
    nothing else (every row a decode row), on the CPU; False where numpy must look."""
    mod = CHECK.get()
    if mod is None or p is None or getattr(p, "prefill", None) or getattr(p, "native_prefill", None) is not None:
        return False
    decode = getattr(p, "decode", None)
    if not decode or len(decode) != 1 or not (hasattr(decode[0], "lens") and hasattr(decode[0], "rows")):
        return False
    g = decode[0]
    try:
        if g.tables.device.type != "cpu":
            return False
        return mod.decode_plan(_ints(g.tok), _ints(g.rows), _ints(g.lens), g.tables.detach().numpy(), rec.computed,
                               rec.scheduled, rec.pages, rec.page_size)
    except (TypeError, BufferError, ValueError, AttributeError, OverflowError):
        return False


# ---- the trial ------------------------------------------------------------------------------------
def _clean_batch_numpy(rec, b) -> bool:
    from . import invariants
    ref = invariants.record_reference(rec)
    return not (invariants.record_mismatches(rec, skip_kinds=("block_table",)) or invariants.maxima_mismatches(b, ref)
                or invariants.logits_mismatches(b, ref))


def _clean_plan_numpy(rec, p) -> bool:
    from . import invariants
    from .plan_check import plan_mismatches
    return not plan_mismatches(p, invariants.record_reference(rec))


def _record(computed, scheduled, pages, tokens, ps=4, **over):
    """A StepRecord and its batch as a builder packs them (copies from the rows' own state), with `over`
    replacing copies or batch fields."""
    from workbench.step_record import StepRecord

    from .invariants import reference
    ref = reference(computed, scheduled, pages, ps)
    ids = np.fromiter((t for toks, a, n in zip(tokens, computed, scheduled) for t in toks[a:a + n]), np.int64)
    slots = np.where(ref.slots >= 0, ref.slots, 0)
    copies = {"positions": ("positions", ref.positions.copy()), "slot_mapping": ("slot_mapping", slots),
              "input_ids": ("input_ids", ids), "query_lens_np": ("q", ref.q_lens.astype(np.int32)),
              "diff(cu_seqlens_q_np)": ("diff_q", ref.cu_q.copy()), "cu_seqlens_q": ("cu_q", ref.cu_q.astype(np.int32)),
              "context_lens": ("ctx", ref.context_lens.copy()), "cu_seqlens_k": ("cu_k", ref.cu_k.copy()),
              "ends": ("ends_q", ref.cu_q[1:].copy()), "ends_kv": ("ends_k", ref.context_lens.copy()),
              "block_tables": ("block_table", ref.table.copy())}
    totals = [len(t) for t in tokens]
    rows = [i for i in range(len(totals)) if ref.context_lens[i] == totals[i]]
    b = SimpleNamespace(max_seqlen_q=int(ref.q_lens.max()), max_seqlen_k=int(ref.context_lens.max()),
                        logits_indices=ref.cu_q[1:][rows] - 1, seqs=[SimpleNamespace(num_tokens=n) for n in totals])
    for k, v in over.items():
        if k in copies:
            copies[k] = (copies[k][0], v)
        else:
            setattr(b, k, v)
    rec = StepRecord(1, "engine", ps, 64, request_ids=list(range(len(totals))), computed=computed, scheduled=scheduled,
                     pages=[list(p) for p in pages], token_ids=[list(t) for t in tokens], copies=copies)
    return rec, b, ref


def trial(mod) -> None:
    """Raises where the module's verdicts are not numpy's: a clean mixed batch (a chunk after cached
    context, a whole prompt, decodes), a short page list, then each copy, the maxima and the sampled rows
    wrong in turn; a clean decode plan, then each of its entries wrong."""
    import torch
    toks = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3], [9, 9, 8, 2, 4, 4]]
    computed, scheduled, pages = [4, 0, 6, 5], [6, 4, 1, 1], [[7, 2, 9], [5], [1, 3], [4, 8]]
    rec0, b0, ref = _record(computed, scheduled, pages, toks)

    def check(what, rec, b):
        want, got = _clean_batch_numpy(rec, b), mod.batch(*_batch_args(rec, b))
        if got != want:
            raise AssertionError(f"batch, {what}: the compiled check says {got}, numpy's {want}")
        return want
    if not check("clean", rec0, b0):
        raise AssertionError("batch: the reference itself calls the trial's clean batch off")
    check("a short page list", *_record(computed, scheduled, [[7, 2], [5], [1, 3], [4, 8]], toks)[:2])
    bump = lambda a, i, d=1: np.where(np.arange(len(a)) == i, a + d, a)            # noqa: E731
    plants = {"a position off by one": ("positions", bump(ref.positions, 3)),
              "a slot of another page": ("slot_mapping", bump(np.where(ref.slots >= 0, ref.slots, 0), 7, 4)),
              "another token id": ("input_ids", bump(rec0.array("input_ids"), 11)),
              "a query length": ("query_lens_np", bump(ref.q_lens, 1).astype(np.int32)),
              "a cu_seqlens whose steps differ": ("diff(cu_seqlens_q_np)", bump(ref.cu_q, 2)),
              "a cumulative query length": ("cu_seqlens_q", bump(ref.cu_q, 4).astype(np.int32)),
              "a context length": ("context_lens", bump(ref.context_lens, 0, -1)),
              "a cumulative context length": ("cu_seqlens_k", bump(ref.cu_k, 1)),
              "an end of a query": ("ends", bump(ref.cu_q[1:], 2)),
              "an end of a context": ("ends_kv", bump(ref.context_lens, 3)),
              "a copy one token short": ("positions", ref.positions[:-1].copy()),
              "the longest query": ("max_seqlen_q", 7), "the longest context": ("max_seqlen_k", 9),
              "a sampled row": ("logits_indices", np.array([9, 11, 12])),
              "a sampled row missing": ("logits_indices", np.array([9, 10]))}
    for what, (k, v) in plants.items():
        if check(what, *_record(computed, scheduled, pages, toks, **{k: v})[:2]):
            raise AssertionError(f"batch, {what}: the numpy check itself finds nothing: the trial plants nothing")
    # the decode plan of a decode-only step
    d_comp, d_sched, d_pages, d_toks = [5, 2, 9], [1, 1, 1], [[4, 8], [6], [1, 3, 2]], [list(range(6)), [1, 2, 3],
                                                                                          list(range(10))]
    drec = _record(d_comp, d_sched, d_pages, d_toks)[0]

    def dplan(tok=(0, 1, 2), rows=(0, 1, 2), lens=(6, 3, 10), tables=((4, 8, 0), (6, 0, 0), (1, 3, 2))):
        g = SimpleNamespace(tok=torch.tensor(tok), rows=torch.tensor(rows), lens=torch.tensor(lens, dtype=torch.int32),
                            tables=torch.tensor(tables, dtype=torch.int32))
        return SimpleNamespace(decode=[g], prefill=[], native_prefill=None)

    def pcheck(what, p):
        g = p.decode[0]
        want = _clean_plan_numpy(drec, p)
        got = mod.decode_plan(_ints(g.tok), _ints(g.rows), _ints(g.lens), g.tables.numpy(), drec.computed,
                              drec.scheduled, drec.pages, drec.page_size)
        if got != want:
            raise AssertionError(f"decode plan, {what}: the compiled check says {got}, numpy's {want}")
        return want
    if not pcheck("clean", dplan()):
        raise AssertionError("decode plan: the reference itself calls the trial's clean plan off")
    for what, p in {"a query at another token": dplan(tok=(0, 2, 1)), "a query reading another row": dplan(rows=(0, 2, 1)),
                    "a row left out": dplan(rows=(0, 0, 2)), "a context length": dplan(lens=(6, 4, 10)),
                    "a page slipped": dplan(tables=((4, 8, 0), (6, 0, 0), (1, 2, 3)))}.items():
        if pcheck(what, p):
            raise AssertionError(f"decode plan, {what}: the numpy check itself finds nothing: the trial plants nothing")
