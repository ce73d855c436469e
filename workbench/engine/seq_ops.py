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


def _load():
    mod = kernels.SEQ_OPS.require()
    return SimpleNamespace(name="compiled", **{k: getattr(mod, k) for k in _NAMES})


_compiled = pool_ops.CompiledOnce(_load, "sequence loops", PYTHON)
compiled, active, unavailable_reason = _compiled.get, _compiled.active, _compiled.why
