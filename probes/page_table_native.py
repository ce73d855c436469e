"""The page_table probe's two checks compiled (csrc/page_table.c): their clean paths; the numpy
checks (PageTableProbe.check_table, .scan) are the ones that report.

The table check, at layer 0 of every forward: the bound block table's bytes against the table rebuilt
from each sequence's own page list (in range, equal over the columns each row reads, no all-zero row
that reads pages, no short page list). `table` says clean in one pass; numpy's ~20 small operations
then do not run (the probe's table check ~0.25 -> ~0.17 ms a forward on SmolLM2's workload A).

The scan, after every step: every live page table against the pool, page ids inside it, no
mapped page free, no page handed out again under a sequence (its generation), and each page's
refcount equal to the number of live tables mapping it. In numpy that is ~30 small operations, each
paying a cold dispatch right after the sampler (~270 us a step on SmolLM2's workload A); the C twin
answers a clean scan in one pass over the page lists and one over the pool's arrays, and says "look"
(None) otherwise: the numpy scan then runs and names each finding. `clean_scan` and `clean_table`
below are their references (the same judgements in numpy), the ones the trial compares them with.

Not available (no C compiler, PAGEDKV_PROBE_KERNELS=numpy, PAGEDKV_CPU_FEATURES=none, a failed
trial): the numpy checks run every time, as before.
"""
from __future__ import annotations

from array import array
from itertools import chain
from pathlib import Path

import numpy as np

from workbench.engine.kernels import Kernel, Spec

CSRC = Path(__file__).with_name("csrc")
CHECKS = Kernel(Spec("pagedkv_page_table_check", (CSRC / "page_table.c",), "compiled page-table checks", kind="c",
                     flags=("-O2",), headers=(CSRC / "buffers.h",), switch=("PAGEDKV_PROBE_KERNELS", "numpy")),
                fallback="the numpy checks (probes/page_table.py)", trial="probes.page_table_native:trial")


def table(read: np.ndarray, rec, num_pages: int) -> bool:
    """True where the numpy table check (PageTableProbe.check_table, up to the backends' own tables) would
    find nothing in `read` (the bound table's bytes, int64 [B, W]) against the page lists of StepRecord
    `rec` (its rows' computed tokens, chunks and own page lists: no reference is built); False where it
    must look, or the compiled check is not available."""
    mod = CHECKS.get()
    if mod is None:
        return False
    try:
        return mod.table(read, rec.computed, rec.scheduled, rec.pages, rec.page_size, int(num_pages))
    except (TypeError, BufferError, ValueError, OverflowError):   # arrays of another dtype or layout: numpy reads them
        return False


def clean_table(read: np.ndarray, ref, num_pages: int) -> bool:
    """The reference: the same verdict in numpy."""
    b = len(ref.need)
    if read.ndim != 2 or read.shape[0] != b or ref.short.any() or (b and read.shape[1] < ref.need.max()):
        return False
    w = min(read.shape[1], ref.table.shape[1])
    cols = np.arange(w)[None, :] < ref.need[:, None]
    a = read[:, :w]
    if (((a < 0) | (a >= num_pages) | (a != ref.table[:, :w])) & cols).any():
        return False
    zero = ~((a != 0) & cols).any(axis=1) & (ref.context_lens > ref.q_lens)
    return not zero.any()


def scan(page_lists: list, generation_lists: list, ref, generation, is_free) -> tuple[int, int] | None:
    """(mapped pages, shared pages) of a clean scan; None where something is off or the compiled scan is
    not available or cannot read these arrays (the numpy scan then runs)."""
    mod = CHECKS.get()
    if mod is None:
        return None
    try:
        return mod.scan(page_lists, generation_lists, ref, generation, is_free)
    except (TypeError, BufferError, ValueError):      # not the pool's own arrays (a list, a view): numpy reads it
        return None


def clean_scan(page_lists: list, generation_lists: list, ref, generation, is_free) -> tuple[int, int] | None:
    """The reference: the same judgement in numpy (what PageTableProbe.scan finds, as one verdict)."""
    n = len(ref)
    lens = np.fromiter(map(len, page_lists), np.int64, len(page_lists))
    pages = np.fromiter(chain.from_iterable(page_lists), np.int64, int(lens.sum()))
    if ((pages < 0) | (pages >= n)).any() or np.asarray(is_free, dtype=bool)[pages].any():
        return None
    if all(len(g) == len(p) for g, p in zip(generation_lists, page_lists)):
        had = np.fromiter(chain.from_iterable(generation_lists), np.int64, len(pages))
        if (np.asarray(generation, dtype=np.int64)[pages] != had).any():
            return None
    counts = np.bincount(pages, minlength=n)
    if (counts != np.asarray(ref, dtype=np.int64)).any():
        return None
    return int(len(pages)), int((counts > 1).sum())


def trial(mod) -> None:
    """Raises where the module's verdicts are not the references': a clean pool with shared pages, then one
    of each thing the scan looks for planted in it; a clean block table, then one of each thing the table
    check looks for."""
    _trial_table(mod)
    n = 12
    lists = [[3, 7, 1], [3, 7, 9], [0]]
    gens = [[2, 1, 1], [2, 1, 4], [1]]

    def pool():
        ref, gen, free = array("q", [0] * n), array("q", [1] * n), array("b", [1] * n)
        for pl, gl in zip(lists, gens):
            for p, g in zip(pl, gl):
                ref[p] += 1
                gen[p], free[p] = g, 0
        return ref, gen, free

    cases = {"clean": lambda r, g, f, ls: None}
    cases["a page outside the pool"] = lambda r, g, f, ls: ls[2].__setitem__(0, n)
    cases["a mapped page free"] = lambda r, g, f, ls: f.__setitem__(9, 1)
    cases["a page handed out again"] = lambda r, g, f, ls: g.__setitem__(1, 5)
    cases["a refcount missing"] = lambda r, g, f, ls: r.__setitem__(3, 1)
    cases["a leaked refcount"] = lambda r, g, f, ls: r.__setitem__(5, 1)
    for what, plant in cases.items():
        ref, gen, free = pool()
        ls = [list(x) for x in lists]
        plant(ref, gen, free, ls)
        want = clean_scan(ls, gens, ref, gen, memoryview(free).toreadonly())
        got = mod.scan(ls, gens, ref, gen, memoryview(free).toreadonly())
        if got != want:
            raise AssertionError(f"{what}: the compiled scan says {got}, numpy's {want}")
    if clean_scan(lists, gens, *pool()) != (7, 2):          # 7 mapped, pages 3 and 7 shared
        raise AssertionError("the reference itself disagrees with the trial's pool")


def _trial_table(mod) -> None:
    from .invariants import reference
    lists = [[4, 2, 7], [6, 5], [0]]
    ref = reference([20, 5, 0], [1, 3, 6], lists, 8)              # contexts 21, 8, 6: 3, 1, 1 pages
    bound = np.array([[4, 2, 7, 0], [6, 9, 9, 9], [0, 0, 0, 0]], dtype=np.int64)   # past need: anything

    def case(what, read, r=ref, n=9):
        want, got = clean_table(read, r, n), mod.table(read, r.starts, r.q_lens, lists, r.page_size, n)
        if got != want:
            raise AssertionError(f"table, {what}: the compiled check says {got}, numpy's {want}")
        return want
    if not case("clean", bound):
        raise AssertionError("table: the reference itself calls the trial's clean table off")
    for what, (r, c, v) in {"a page slipped": (0, 1, 7), "a page outside the pool": (1, 0, 9),
                            "a negative page": (0, 2, -1)}.items():
        bad = bound.copy()
        bad[r, c] = v
        case(what, bad)
    case("an all-zero row that reads pages", np.where(np.arange(3)[:, None] == 1, 0, bound))
    case("a table narrower than a context", np.ascontiguousarray(bound[:, :2]))
    case("a row missing", bound[:2])
    case("a short page list", bound, reference([20, 5, 0], [1, 12, 6], lists, 8))    # context 17: 3 pages
