"""The scheduler's and the simulator's per-sequence loops: Python here, compiled (csrc/seq_ops.c)
when a C compiler is at hand (built and loaded by the kernels loader, as pool_ops.py's loops are).

Every step walks every running sequence twice: the scheduler, to give each its next tokens
(most are decodes whose last page still has room), and the simulator, to advance each by
the tokens it computed. A replay of a production trace does that ~250 times a step for ~90k
steps, so in Python these two loops were a third of its time. Both are plain functions with
the same arguments, results and attribute writes in Python (the reference) and in C:

    fit_running(running, i, budget, page_size, out) -> (i, budget)
        appends (seq, n) to out for running[i:] while their n tokens fit the pages they map;
        stops at the first that needs pages (the caller grows or preempts it) or an empty budget
    advance(scheduled, page_size, register, clock, produced, special) -> None
        each scheduled (seq, n): n more tokens computed; a sequence whose whole context is now
        computed produces a token (num_tokens, num_output, first_token_time); appended to
        special as (seq, done) when a page filled (register: prefix caching) or its length rule
        stops it (done), so the caller does the pool work in the original order
    token_counts(scheduled) -> (tokens, prefill tokens)
    packed_columns(scheduled) -> (request ids, tokens, context after the step): BatchPacked's tuples
    mapped(running, page_size) -> (waste, pages)
        slots left empty in the running sequences' last pages, and the pages they map (a replay's
        per-step row)

No compiler, PAGEDKV_POOL=python or a refused build: the Python functions run, same results, slower.
"""
from __future__ import annotations

from types import SimpleNamespace

from . import kernels, pool_ops

SOURCE = kernels.SEQ_OPS.spec.sources[0]


def fit_running(running, i, budget, ps, out):
    while i < len(running) and budget > 0:
        seq = running[i]
        c = seq.num_computed_tokens
        n = min(seq.num_tokens - c, budget)
        if c + n > len(seq.pages) * ps:
            break
        out.append((seq, n))
        budget -= n
        i += 1
    return i, budget


def advance(scheduled, ps, register, clock, produced, special):
    if ps < 1:
        raise ValueError("seq_ops.advance: page_size must be >= 1")
    for seq, n in scheduled:
        c = seq.num_computed_tokens + n
        seq.num_computed_tokens = c
        filled = register and c // ps > len(seq.page_hashes)
        done = False
        if c == seq.num_tokens:
            seq.num_tokens = c + 1
            seq.num_output += 1
            if seq.first_token_time is None:
                seq.first_token_time = clock
            done = c + 1 >= seq.stop_at
            produced.append(seq)
        if filled or done:
            special.append((seq, int(done)))


def mapped(running, ps):
    if ps < 1:
        raise ValueError("seq_ops.mapped: page_size must be >= 1")
    return sum(-s.num_computed_tokens % ps for s in running), sum(len(s.pages) for s in running)


def token_counts(scheduled):
    return sum(n for _, n in scheduled), sum(n for _, n in scheduled if n > 1)


def packed_columns(scheduled):
    return (tuple(s.request_id for s, _ in scheduled), tuple(n for _, n in scheduled),
            tuple(s.num_computed_tokens + n for s, n in scheduled))


_NAMES = ("fit_running", "advance", "mapped", "token_counts", "packed_columns")
PYTHON = SimpleNamespace(name="python", **{k: globals()[k] for k in _NAMES})


def _seqs() -> list:
    mk = SimpleNamespace
    return [mk(request_id=i, num_computed_tokens=c, num_tokens=t, pages=[0] * p, page_hashes=[0] * h, num_output=o,
               first_token_time=None, stop_at=s)
            for i, (c, t, p, h, o, s) in enumerate([(0, 7, 1, 0, 0, 99), (15, 16, 1, 0, 0, 17), (16, 17, 2, 1, 3, 40),
                                                     (31, 32, 2, 1, 1, 33)])]


def _script(ops, ps: int = 16) -> list:
    seqs = _seqs()
    out: list = []
    i, budget = ops.fit_running(seqs, 0, 12, ps, out)
    sched = [(seqs[0], 7), (seqs[1], 1), (seqs[2], 1), (seqs[3], 1)]
    result = [[(s.request_id, n) for s, n in out], i, budget, ops.token_counts(sched), ops.packed_columns(sched),
              ops.mapped(seqs, ps)]
    produced, special = [], []
    ops.advance(sched, ps, True, 2.5, produced, special)
    return result + [[s.request_id for s in produced], [(s.request_id, d) for s, d in special],
                     [vars(s) for s in seqs]]


def trial(ops) -> None:
    """The compiled loops against the Python ones on four sequences (kernels/trials.py)."""
    got, want = _script(ops), _script(PYTHON)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise kernels.trials.Mismatch(f"sequence loops, result {i}: {g!r} where the Python loops give {w!r}")


def _load():
    mod = kernels.SEQ_OPS.require()
    return SimpleNamespace(name="compiled", **{k: getattr(mod, k) for k in _NAMES})


_compiled = pool_ops.CompiledOnce(_load, "sequence loops", PYTHON)
compiled, active, unavailable_reason = _compiled.get, _compiled.active, _compiled.why
