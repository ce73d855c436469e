"""The page write ledger's step compiled (csrc/page_writes.c): its clean path; the numpy step
(PageWriteLedger.step in page_writes.py) is the reference, and the one that reports.

After every step the prefix_cache probe's ledger digests each row's new positions, checks the
positions a row holds without having computed them (its prefix-cache hits) against the digest last
written to each slot, and records the step's writes. In numpy that is ~30 small operations, each a
cold dispatch right after the sampler (~0.35 ms a step on SmolLM2's workload A); the C twin does the
step in one pass over the rows. It checks everything before it writes anything, and where a hit
disagrees, or the rows are not the engine's own types (int request ids, token ids and page lists as
lists of ints), it returns None with the ledger untouched: the numpy step then runs and names the
mismatch.

Tried once per process (`trial`) against the numpy step over a run of steps (a prefill, decodes, a
clean prefix hit, a recompute after preemption, a short page list, a slot outside the ledger) and
with each kind of mismatch planted. Not available (no C compiler, PAGEDKV_PROBE_KERNELS=numpy,
PAGEDKV_CPU_FEATURES=none, a failed trial): the numpy step runs every time, as before.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.engine.kernels import Kernel, Spec

CSRC = Path(__file__).with_name("csrc")
STEP = Kernel(Spec("pagedkv_page_writes", (CSRC / "page_writes.c",), "compiled page write ledger", kind="c",
                   flags=("-O2",), headers=(CSRC / "buffers.h",), switch=("PAGEDKV_PROBE_KERNELS", "numpy")),
              fallback="the numpy ledger (probes/page_writes.py)", trial="probes.page_writes_native:trial")


def ledger_step(ledger, rows: list, slot_mapping, strict: bool = False, before=None) -> list:
    """ledger.step(rows, slot_mapping, strict, before) (PageWriteLedger), run compiled where the step is
    clean: the ledger's arrays, running digests, verified rows and counters end the same either way, and
    a step with a mismatch (or rows the C does not read) goes to the numpy step, which names it."""
    got = step(ledger, rows, slot_mapping, strict, before)
    if got is None:
        return ledger.step(rows, slot_mapping, strict=strict, before=before)
    ledger.verified, checked, written, ledger.pages_written = got
    ledger.positions_checked += checked
    ledger.slots_written += written
    return []


def step(ledger, rows: list, slot_mapping, strict: bool, before) -> tuple | None:
    """(verified, positions checked, slots written, pages written) of a clean step, the ledger updated;
    None where the numpy step must run (a mismatch, rows of other types, the module not available)."""
    mod = STEP.get()
    if mod is None or not isinstance(rows, list):
        return None
    if slot_mapping is not None and not (isinstance(slot_mapping, np.ndarray) and slot_mapping.dtype == np.int64):
        return None
    try:
        return mod.step(rows, slot_mapping, ledger.state, ledger.seed, ledger.writer, ledger.pos, ledger.tok,
                        ledger.digest, ledger.page_size, strict, before)
    except (TypeError, BufferError, ValueError, OverflowError):     # arrays of another layout: numpy reads them
        return None


def trial(mod) -> None:
    """Raises where the module's step is not the numpy step's: a run of clean steps compared array by
    array (and state, verified rows, counters), then each kind of mismatch planted, which it must
    leave to numpy (None, the ledger untouched)."""
    from .page_writes import PageWriteLedger
    ps, npages = 4, 16

    def pair():
        return PageWriteLedger(npages, ps), PageWriteLedger(npages, ps)

    def run(led, compiled, rows, sm, strict=False):
        before = np.full(len(sm), -7, dtype=np.int64) if sm is not None else None
        if not compiled:
            found = led.step(rows, sm, strict=strict, before=before)
            return (found, led.verified, led.positions_checked, led.slots_written, led.pages_written, before)
        got = mod.step(rows, sm, led.state, led.seed, led.writer, led.pos, led.tok, led.digest, led.page_size,
                       strict, before)
        if got is None:
            return None
        verified, checked, written, pages = got
        led.positions_checked += checked
        led.slots_written += written
        return ([], verified, led.positions_checked, led.slots_written, pages, before)

    def same(a: PageWriteLedger, b: PageWriteLedger, what: str) -> None:
        for name in ("writer", "pos", "tok", "digest"):
            if not np.array_equal(getattr(a, name), getattr(b, name)):
                raise AssertionError(f"{what}: the compiled step wrote another {name} than numpy's")
        if a.state != b.state:
            raise AssertionError(f"{what}: the compiled step kept other running digests than numpy's")

    a_toks = [5, 9, 2, 7, 1, 1, 3, 8, 4, 6]
    b_toks = [5, 9, 2, 7, 1, 1, 3, 8, 2, 2, 2]          # b shares a's first two pages
    sm = lambda *xs: np.asarray(xs, dtype=np.int64)     # noqa: E731
    steps = [
        ("a prefill", [(1, a_toks, 0, 9, [3, 5, 7])], sm(12, 13, 14, 15, 20, 21, 22, 23, 28)),
        ("a decode", [(1, a_toks, 9, 1, [3, 5, 7])], sm(29)),
        ("a clean prefix hit beside a decode", [(2, b_toks, 8, 2, [3, 5, 2]), (1, a_toks + [0], 10, 1, [3, 5, 7])],
         sm(8, 9, 30)),
        ("a recompute after preemption", [(1, a_toks + [0], 0, 11, [0, 1, 4])], sm(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18)),
        ("a short page list and a slot outside", [(2, b_toks + [4], 10, 2, [3, 5, 2]), (3, [1, 2, 3, 4, 5, 6], 4, 2, [])],
         sm(10, 64, 36, -1)),
        ("no slot mapping", [(3, [1, 2, 3, 4, 5, 6, 7], 6, 1, [9, 9])], None),
    ]
    a, b = pair()
    for what, rows, slots in steps:
        want = run(a, False, [tuple(r) for r in rows], slots)
        got = run(b, True, [tuple(r) for r in rows], slots)
        if got is None:
            raise AssertionError(f"{what}: the compiled step left a clean step to numpy")
        if want[0]:
            raise AssertionError(f"{what}: the numpy step itself found a mismatch in the trial's clean run")
        if got[1:5] != want[1:5] or (want[5] is not None and not np.array_equal(got[5], want[5])):
            raise AssertionError(f"{what}: the compiled step says {got[1:5]}, numpy's {want[1:5]}")
        same(a, b, what)
    if a.positions_checked == 0 or a.slots_written < 20:
        raise AssertionError("the trial's run checked no hit or wrote too little: it proves nothing")

    # each mismatch: numpy finds it; the compiled step must leave it (None) and write nothing
    def planted(what, prepare, rows, slots, strict=False):
        a, b = pair()
        for led in (a, b):
            run(led, False, [(1, a_toks, 0, 9, [3, 5, 7])], sm(12, 13, 14, 15, 20, 21, 22, 23, 28))
            prepare(led)
        want = run(a, False, rows, slots, strict)
        snapshot = [getattr(b, n).copy() for n in ("writer", "pos", "tok", "digest")], dict(b.state)
        got = run(b, True, rows, slots, strict)
        if not want[0]:
            raise AssertionError(f"{what}: the numpy step itself finds nothing")
        if got is not None:
            raise AssertionError(f"{what}: the compiled step called a mismatching hit clean")
        if any(not np.array_equal(x, getattr(b, n)) for x, n in zip(snapshot[0], ("writer", "pos", "tok", "digest"))) \
                or snapshot[1] != b.state:
            raise AssertionError(f"{what}: the compiled step wrote into the ledger before giving the step to numpy")

    other = [5, 9, 2, 6, 1, 1, 3, 8, 2]                 # differs from a at position 3
    planted("a hit on another history", lambda led: None, [(2, other, 8, 1, [3, 5, 2])], sm(8))
    planted("a hit on a page written at another index", lambda led: None, [(2, a_toks[:4] * 2 + [1], 8, 1, [3, 3, 2])],
            sm(8))
    planted("a hit on a slot never written (strict)", lambda led: None, [(2, a_toks, 8, 1, [3, 6, 2])], sm(8),
            strict=True)
    planted("a hit on a slot overwritten since", lambda led: led.digest.__setitem__(14, 12345),
            [(2, a_toks, 8, 1, [3, 5, 2])], sm(8))
