"""The scheduler's and simulator's per-sequence loops (engine/seq_ops.py): the compiled twin
against the Python reference, on the real sequence classes, call for call."""
from __future__ import annotations

import random

import pytest

from workbench.engine import seq_ops
from workbench.engine.sequence import SamplingParams, Sequence
from workbench.trace.simulate import SimSequence

COMPILED = seq_ops.compiled()
needs_compiled = pytest.mark.skipif(COMPILED is None, reason=f"no compiled loops: {seq_ops.unavailable_reason()}")


def _engine_seqs(rng, n, ps):
    out = []
    for i in range(n):
        toks = [rng.randrange(100) for _ in range(rng.randint(1, 40))]
        s = Sequence(i, toks, SamplingParams(max_tokens=8), 64)
        s.num_computed_tokens = rng.randint(0, len(toks) - 1)
        s.pages = list(range(rng.randint(0, -(-len(toks) // ps) + 1)))
        out.append(s)
    return out


def _sim_seqs(rng, n, ps):
    out = []
    for i in range(n):
        plen = rng.randint(1, 40)
        s = SimSequence(i, plen, SamplingParams(max_tokens=rng.randint(1, 4), ignore_eos=True), 1 << 20)
        s.num_computed_tokens = rng.randint(0, plen - 1)
        s.pages = list(range(-(-plen // ps)))
        s.page_hashes = list(range(rng.randint(0, s.num_computed_tokens // ps)))
        s.first_token_time = rng.choice([None, 1.5])
        out.append(s)
    return out


def _snap(seqs):
    return [(s.num_computed_tokens, s.num_tokens, getattr(s, "num_output", None), s.first_token_time) for s in seqs]


@needs_compiled
@pytest.mark.parametrize("kind", ["engine", "sim"])
def test_fit_running_matches_the_reference(kind):
    for seed in range(200):
        rng = random.Random(seed)
        ps = rng.choice([1, 4, 16])
        make = _engine_seqs if kind == "engine" else _sim_seqs
        seqs = make(rng, rng.randint(0, 12), ps)
        i0, budget = rng.randint(0, 3), rng.randint(0, 60)
        results = []
        for impl in (seq_ops.PYTHON, COMPILED):
            out = []
            results.append((impl.fit_running(seqs, i0, budget, ps, out), [(s.request_id, n) for s, n in out]))
        assert results[0] == results[1], seed


def test_fit_running_stops_at_the_sequence_that_needs_pages():
    ps = 4
    a, b, c = (Sequence(i, list(range(10)), SamplingParams(), 64) for i in range(3))
    a.num_computed_tokens, a.pages = 9, [0, 1, 2]          # its last token fits page 2
    b.num_computed_tokens, b.pages = 8, [3, 4]             # 2 tokens left, but 8 slots mapped: needs a page
    c.num_computed_tokens, c.pages = 9, [5, 6, 7]
    for impl in filter(None, (seq_ops.PYTHON, COMPILED)):
        out = []
        assert impl.fit_running([a, b, c], 0, 100, ps, out) == (1, 99)
        assert out == [(a, 1)]
        out = []
        assert impl.fit_running([a, b, c], 2, 100, ps, out) == (3, 99)
        assert impl.fit_running([a, b, c], 0, 0, ps, out) == (0, 0)      # no budget: nothing


@needs_compiled
def test_advance_matches_the_reference():
    for seed in range(200):
        rng = random.Random(seed)
        ps = rng.choice([1, 4, 16])
        register = rng.random() < 0.7
        runs = []
        for impl in (seq_ops.PYTHON, COMPILED):
            seqs = _sim_seqs(random.Random(seed), 10, ps)          # the same sequences for both
            pick = random.Random(seed + 1)
            sched = [(s, pick.randint(1, s.num_tokens - s.num_computed_tokens)) for s in seqs]
            produced, special = [], []
            impl.advance(sched, ps, register, 2.5, produced, special)
            runs.append((_snap(seqs), [s.request_id for s in produced], [(s.request_id, d) for s, d in special]))
        assert runs[0] == runs[1], seed


def test_advance_finishes_on_the_length_rule_only_after_a_token():
    ps = 4
    s = SimSequence(0, 10, SamplingParams(max_tokens=1, ignore_eos=True), 1 << 20)
    s.pages = [0, 1, 2]
    for impl in filter(None, (seq_ops.PYTHON, COMPILED)):
        s.num_computed_tokens, s.num_tokens, s.num_output, s.first_token_time, s.page_hashes = 0, 10, 0, None, []
        produced, special = [], []
        impl.advance([(s, 9)], ps, True, 1.0, produced, special)        # 9 of 10 prompt tokens: no token yet
        assert (produced, special, s.num_tokens) == ([], [(s, 0)], 10)   # two pages filled, not done
        produced, special = [], []
        s.page_hashes = [1, 2]
        impl.advance([(s, 1)], ps, True, 2.0, produced, special)
        assert produced == [s] and special == [(s, 1)]                   # its one token: the length rule stops it
        assert (s.num_tokens, s.num_output, s.first_token_time) == (11, 1, 2.0)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_page_size_is_refused(bad):
    for impl in filter(None, (seq_ops.PYTHON, COMPILED)):
        with pytest.raises(ValueError, match="page_size"):
            impl.advance([], bad, True, 0.0, [], [])
        with pytest.raises(ValueError, match="page_size"):
            impl.mapped([], bad)


@needs_compiled
def test_mapped_matches_the_reference():
    for seed in range(100):
        rng = random.Random(seed)
        ps = rng.choice([1, 4, 16])
        seqs = _engine_seqs(rng, rng.randint(0, 12), ps)
        assert COMPILED.mapped(seqs, ps) == seq_ops.PYTHON.mapped(seqs, ps)


@needs_compiled
def test_a_replay_is_the_same_on_both():
    """The whole simulated replay of the bundled Mooncake excerpt: same steps, same events."""
    from workbench import EngineConfig
    from workbench.data import mooncake_excerpt
    from workbench.trace import read_trace, replay
    trace = read_trace(mooncake_excerpt())
    cfg = EngineConfig(page_size=16, num_pages=512, max_num_seqs=32, max_num_batched_tokens=2048)
    runs = []
    for impl in (seq_ops.PYTHON, COMPILED):
        state = seq_ops._compiled.state
        saved = dict(state)
        state["ops"] = impl                  # what the scheduler, simulator and lifecycle pick up
        try:
            res = replay(trace, cfg, "simulate", progress=False)
        finally:
            state.clear()
            state.update(saved)
        runs.append((res.steps.to_csv(), {str(k): {c: list(v) for c, v in t.items()} for k, t in res.log.tables.items()}))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]
    assert len(runs[0][1]) > 3
