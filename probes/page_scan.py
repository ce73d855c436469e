"""The page_table probe's scan compiled (csrc/page_scan.c): its clean path; the numpy scan
(PageTableProbe.scan) is the one that reports.

After every step the probe checks every live page table against the pool: page ids inside it, no
mapped page free, no page handed out again under a sequence (its generation), and each page's
refcount equal to the number of live tables mapping it. In numpy that is ~30 small operations, each
paying a cold dispatch right after the sampler (~270 us a step on SmolLM2's workload A); the C twin
answers a clean scan in one pass over the page lists and one over the pool's arrays, and says "look"
(None) otherwise: the numpy scan then runs and names each finding. `clean_scan` below is its
reference (the same judgement in numpy), the one its trial compares it with.

Not available (no C compiler, PAGEDKV_PROBE_KERNELS=numpy, PAGEDKV_CPU_FEATURES=none, a failed
trial): the numpy scan runs every step, as before.
"""
from __future__ import annotations

from array import array
from itertools import chain
from pathlib import Path

import numpy as np

from workbench.engine.kernels import Kernel, Spec

SOURCE = Path(__file__).with_name("csrc") / "page_scan.c"
SCAN = Kernel(Spec("pagedkv_page_scan", (SOURCE,), "compiled page-table scan", kind="c", flags=("-O2",),
                   headers=(), switch=("PAGEDKV_PROBE_KERNELS", "numpy")),
              fallback="the numpy scan (probes/page_table.py)", trial="probes.page_scan:trial")


def scan(page_lists: list, generation_lists: list, ref, generation, is_free) -> tuple[int, int] | None:
    """(mapped pages, shared pages) of a clean scan; None where something is off or the compiled scan is
    not available or cannot read these arrays (the numpy scan then runs)."""
    mod = SCAN.get()
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
    """Raises where the module's verdict is not clean_scan's: a clean pool with shared pages, then one of
    each thing the scan looks for planted in it."""
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
