"""The attention plan against the reference: the index tensors the kernels actually walk.

A backend turns the batch into a per-step plan (decode groups or the compiled kernel's
rows, prefill spans, the pages each reads, the masks) once, and every layer reuses it.
A bug there — a decode row mapped to another row's table, a context length off by one,
a causal mask that lets a query see the next key — garbles every layer while the batch
itself is right. These checks read the plan's tensors and compare them with the
reference rebuilt from the sequences (invariants.PackingReference), by duck typing on
the plan shapes of our backends (attention/torch_ref.py, cpu_paged.py, and the compiled
prefill kernel's own chunk rows and tables, cpu_paged.NativePrefill); an unknown plan is
skipped (the shadow probe still recomputes its numerics).
"""
from __future__ import annotations

import numpy as np
import torch

from .invariants import MAX_REPORTED, Mismatch, PackingReference


def _np(t) -> np.ndarray:
    """t's values as int64 numpy, flat (a CPU tensor read in place before the cast: no device move)."""
    return (t if t.device.type == "cpu" else t.detach().cpu()).detach().numpy().astype(np.int64).reshape(-1)


def _row_of_token(ref: PackingReference, tok: np.ndarray) -> np.ndarray:
    return ref.seq_of_tok[np.clip(tok, 0, max(ref.num_tokens - 1, 0))]


def _decode_native(g, ref: PackingReference, out: list) -> set:
    """The compiled decode kernel's rows (token, batch row, context length each) and its tables. Judged
    vectorised over every row (this runs every step); the per-row Python below runs only for a bad row."""
    tok, rows, lens = _np(g.tok), _np(g.rows), _np(g.lens)
    b = len(ref.q_lens)
    # np.minimum / np.maximum, not np.clip: clip's Python-level dispatch cost ~25 us a call here, cold
    r_ok = (rows >= 0) & (rows < b)
    rc = np.minimum(np.maximum(rows, 0), max(b - 1, 0))
    t_ok = (tok >= 0) & (tok < ref.num_tokens)
    tc = np.minimum(np.maximum(tok, 0), max(ref.num_tokens - 1, 0))
    if b and ref.num_tokens:
        row_ok = r_ok & t_ok & (tok == ref.cu_q[rc]) & (ref.seq_of_tok[tc] == rows)
        len_ok = ~row_ok | (lens == ref.context_lens[rc])
    else:
        row_ok = len_ok = np.zeros(len(tok), dtype=bool)
    for k in np.nonzero(~(row_ok & len_ok))[0].tolist():
        r = int(rows[k])
        if not row_ok[k]:
            out.append(Mismatch("plan", "plan.decode.rows", int(_row_of_token(ref, tok[k:k + 1])[0]), int(tok[k]),
                                r, int(_row_of_token(ref, tok[k:k + 1])[0])))
        else:
            out.append(Mismatch("plan", "plan.decode.lens", r, int(tok[k]), int(lens[k]), int(ref.context_lens[r])))
    tables = (g.tables if g.tables.device.type == "cpu" else g.tables.cpu()).detach().numpy().astype(np.int64)
    # the distinct rows the kernel walks: a bincount over b slots when every row is one (not a sort)
    seen = np.flatnonzero(np.bincount(rows, minlength=b)) if r_ok.all() else np.unique(rows)
    at = seen[(seen >= 0) & (seen < min(len(ref.need), tables.shape[0]))]
    w = min(tables.shape[1], ref.table.shape[1])
    if len(at) and w:
        cols = np.arange(w)[None, :] < np.minimum(ref.need[at], tables.shape[1])[:, None]
        bad = (tables[at, :w] != ref.table[at, :w]) & cols & ~ref.short[at][:, None]
        for i in np.nonzero(bad.any(axis=1))[0].tolist():
            r, c = int(at[i]), int(np.argmax(bad[i]))
            out.append(Mismatch("plan", "plan.decode.tables", r, c, int(tables[r, c]), int(ref.table[r, c])))
    return set(seen.tolist())


def _decode_group(g, ref: PackingReference, out: list) -> set:
    tok = _np(g.tok)
    rows = _row_of_token(ref, tok)
    w = int(g.width)
    pages = _np(g.pages).reshape(len(tok), w) if len(tok) else np.zeros((0, w), dtype=np.int64)
    ps = ref.page_size
    for k, r in enumerate(rows.tolist()):
        if ref.q_lens[r] != 1 or tok[k] != ref.cu_q[r]:
            out.append(Mismatch("plan", "plan.decode.tok", r, int(tok[k]), int(tok[k]), int(ref.cu_q[r])))
            continue
        n = int(ref.need[r])
        if n > w:
            out.append(Mismatch("plan", "plan.decode.pages", r, w, None, int(ref.table[r, w])))
            continue
        bad = np.nonzero(pages[k, :n] != ref.table[r, :n])[0]
        if len(bad) and not ref.short[r]:
            c = int(bad[0])
            out.append(Mismatch("plan", "plan.decode.pages", r, c, int(pages[k, c]), int(ref.table[r, c])))
            continue
        ctx = int(ref.context_lens[r])
        if g.mask is None:
            if ctx != w * ps:
                out.append(Mismatch("plan", "plan.decode.mask", r, ctx, w * ps, ctx))
        else:
            allowed = int(g.mask[k].reshape(-1)[: w * ps].sum())
            first_off = g.mask[k].reshape(-1)[:ctx].all()
            if allowed != ctx or not bool(first_off):
                out.append(Mismatch("plan", "plan.decode.mask", r, ctx, allowed, ctx))
    return set(rows.tolist())


def _prefill(s, ref: PackingReference, out: list) -> int | None:
    a, b = int(s.start), int(s.end)
    if not 0 <= a < max(ref.num_tokens, 1):
        out.append(Mismatch("plan", "plan.prefill.start", -1, a, a, None))
        return None
    r = int(ref.seq_of_tok[a])
    if a != ref.cu_q[r] or b != ref.cu_q[r + 1]:
        out.append(Mismatch("plan", "plan.prefill.span", r, a, b - a, int(ref.q_lens[r])))
        return r
    c, n = int(s.context), b - a
    if c != ref.context_lens[r]:
        out.append(Mismatch("plan", "plan.prefill.context", r, a, c, int(ref.context_lens[r])))
        return r
    if s.pages is None:
        if c != n:                       # a chunk after cached context must read its pages
            out.append(Mismatch("plan", "plan.prefill.pages", r, a, None, int(ref.need[r])))
        return r
    pages = _np(s.pages)
    need = int(ref.need[r])
    bad = np.nonzero(pages[:need] != ref.table[r, :need])[0] if len(pages) >= need else np.array([len(pages)])
    if len(bad) and not ref.short[r]:
        col = int(bad[0])
        out.append(Mismatch("plan", "plan.prefill.pages", r, col, int(pages[col]) if col < len(pages) else None,
                            int(ref.table[r, col])))
        return r
    if s.mask is not None:
        m = s.mask.to("cpu")
        want = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]      # bottom-right causal
        if m.shape != want.shape or not torch.equal(m.bool(), want):
            if m.shape == want.shape:
                row = int(torch.nonzero((m.bool() != want).any(1))[0])
                got, exp = int(m[row].sum()), int(want[row].sum())
            else:
                row, got, exp = 0, int(m.shape[-1]), c
            out.append(Mismatch("plan", "plan.prefill.mask", r, a + row, got, exp))
    return r


def _native_prefill(npf, ref: PackingReference, out: list) -> set:
    """The compiled prefill kernel's own inputs (cpu_paged.NativePrefill: the chunk rows and page
    tables it walks, built from plan.prefill) against the reference: a bug in that translation
    would garble prefill while plan.prefill itself is right. Returns the rows it covers."""
    covered: set = set()
    chunks = npf.chunks.detach().to("cpu").numpy().astype(np.int64).reshape(-1, 6)
    tables = npf.tables.detach().to("cpu").numpy().astype(np.int64)
    for k, (start, n, c, row, fresh, off) in enumerate(chunks.tolist()):
        if not 0 <= start < max(ref.num_tokens, 1):
            out.append(Mismatch("plan", "plan.native_prefill.start", -1, k, start, None))
            continue
        r = int(ref.seq_of_tok[start])
        covered.add(r)
        if start != ref.cu_q[r] or n != ref.q_lens[r]:
            out.append(Mismatch("plan", "plan.native_prefill.span", r, start, n, int(ref.q_lens[r])))
        elif c != ref.context_lens[r]:
            out.append(Mismatch("plan", "plan.native_prefill.context", r, start, c, int(ref.context_lens[r])))
        elif off != 0:                                   # the reference mask is plain causal
            out.append(Mismatch("plan", "plan.native_prefill.mask", r, start, off, 0))
        elif fresh:
            if c != n:                                   # fresh k/v hold only this chunk's keys
                out.append(Mismatch("plan", "plan.native_prefill.pages", r, start, None, int(ref.need[r])))
        elif not 0 <= row < tables.shape[0]:
            out.append(Mismatch("plan", "plan.native_prefill.tables", r, start, row, None))
        else:
            need = min(int(ref.need[r]), tables.shape[1])
            bad = np.nonzero(tables[row, :need] != ref.table[r, :need])[0]
            if need < int(ref.need[r]):
                bad = np.append(bad, need)
            if len(bad) and not ref.short[r]:
                col = int(bad[0])
                got = int(tables[row, col]) if col < tables.shape[1] else None
                out.append(Mismatch("plan", "plan.native_prefill.tables", r, col, got, int(ref.table[r, col])))
    for s in npf.rest:                                   # entries left to SDPA: checked as plan.prefill
        if 0 <= int(s.start) < ref.num_tokens:
            covered.add(int(ref.seq_of_tok[int(s.start)]))
    return covered


def plan_mismatches(plan, ref: PackingReference) -> list[Mismatch]:
    """The plan's decode and prefill entries against the reference (our backends' plan shapes)."""
    decode, prefill = getattr(plan, "decode", None), getattr(plan, "prefill", None)
    if decode is None or prefill is None:
        return []
    out: list[Mismatch] = []
    covered: set = set()
    for g in decode:
        if hasattr(g, "lens") and hasattr(g, "rows"):
            covered |= _decode_native(g, ref, out)
        elif hasattr(g, "pages") and hasattr(g, "width"):
            covered |= _decode_group(g, ref, out)
        else:
            return out                    # a plan shape we do not know
    prefill_rows = set()
    for s in prefill:
        r = _prefill(s, ref, out)
        if r is not None:
            prefill_rows.add(r)
    covered |= prefill_rows
    npf = getattr(plan, "native_prefill", None)
    if npf is not None:                  # the compiled kernel runs these, not plan.prefill itself
        native_rows = _native_prefill(npf, ref, out)
        for r in sorted(prefill_rows - native_rows)[:MAX_REPORTED]:
            out.append(Mismatch("plan", "plan.native_prefill (no chunk)", r, int(ref.cu_q[r]), None, int(ref.q_lens[r])))
    missing = sorted(set(range(len(ref.q_lens))) - covered)
    for r in missing[:MAX_REPORTED]:
        out.append(Mismatch("plan", "plan (no entry)", r, int(ref.cu_q[r]), None, int(ref.q_lens[r])))
    return out[: 4 * MAX_REPORTED]
