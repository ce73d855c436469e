"""Page pool invariants under hypothesis stateful testing.

A model of the KV contents (which tokens each page slot holds) rides along: a prefix
hit must hand out a page whose contents equal the requesting sequence's tokens.
"""
from array import array
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workbench.engine.kv_manager import KVCacheManager, pages_for
from workbench.engine import pool_ops
from workbench.engine.pages import POOL_EVENTS, NoFreePages, PagePool
from workbench.engine.sequence import SamplingParams, Sequence
from workbench.events import PagesAllocated, PagesEvicted, PagesFreed, PagesRegistered, PagesShared

PS = 16
PREFIXES = [[7] * 40, [7] * 20 + [8] * 20, list(range(50))]


class PoolMachine(RuleBasedStateMachine):
    OPS = None                                    # the pool's loops: what PagePool picks (compiled if it loads)

    @initialize(num_pages=st.integers(4, 40))
    def setup(self, num_pages):
        self.pool = PagePool(num_pages, PS)
        if self.OPS is not None:
            self.pool._ops = self.OPS
        self.kv = KVCacheManager(self.pool)
        self.live: list[Sequence] = []
        self.content: dict[int, list] = {}     # page -> tokens written in its slots
        self.next_id = 0

    def _write(self, seq, start, end):
        for pos in range(start, end):
            page = seq.pages[pos // PS]
            slots = self.content.setdefault(page, [None] * PS)
            slots[pos % PS] = seq.token_ids[pos]

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(0, 3), max_size=30),
          chunk=st.integers(1, 64))
    def admit(self, prefix, tail, chunk):
        toks = PREFIXES[prefix] + tail
        seq = Sequence(self.next_id, toks, SamplingParams(), max_len=10_000)
        self.next_id += 1
        n = self.kv.try_admit(seq, chunk)
        if n == 0:
            assert seq.pages == []
            return
        for i in range(seq.num_cached_tokens // PS):          # a hit must carry equal tokens
            assert self.content[seq.pages[i]] == toks[i * PS:(i + 1) * PS]
        self._write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.kv.cache_full_pages(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), n=st.integers(1, 40), tok=st.integers(0, 3))
    def append(self, i, n, tok):
        seq = self.live[i % len(self.live)]
        if seq.num_computed_tokens == seq.num_tokens:           # decode: a new token arrives
            seq.append_token(tok)
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        if not self.kv.grow(seq, n):
            return
        self._write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.kv.cache_full_pages(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self.kv.release(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        seq = self.live.pop(i % len(self.live))
        self.kv.release(seq)
        seq.num_computed_tokens = 0

    @rule(n=st.integers(1, 8))
    def pressure(self, n):
        """A foreign allocation that evicts cached-free pages from the LRU head."""
        try:
            pages = self.pool.allocate(n, "pressure")
        except NoFreePages:
            return
        for p in pages:
            self.content.pop(p, None)
        self.pool.free(pages, "pressure")

    @rule(pages=st.lists(st.integers(0, 39), max_size=6))
    def flush(self, pages):
        """A prefix-cache flush of some pages, free or in use (what a fault's clean-up does)."""
        self.pool.forget([p for p in pages if p < self.pool.num_pages])

    @invariant()
    def accounting(self):
        pool = self.pool
        free = pool.free_order()
        assert len(free) == len(set(free)) == pool.num_free
        assert pool.num_free + pool.num_used == pool.num_pages
        mapped = Counter(p for s in self.live for p in s.pages)
        assert not set(free) & set(mapped), "a page is both free and mapped"
        for p in range(pool.num_pages):
            assert pool.ref[p] == mapped.get(p, 0), f"page {p}: ref {pool.ref[p]} != {mapped.get(p, 0)} tables"
        assert pool.num_used == len(mapped)
        assert pool.num_cached_free == sum(1 for p in free if pool.page_hash[p] is not None)

    @invariant()
    def no_reuse_under_a_live_sequence(self):
        for s in self.live:
            assert [self.pool.generation[p] for p in s.pages] == s.page_generations
            assert len(s.pages) == pages_for(s.num_computed_tokens, PS)   # no over-reservation

    @invariant()
    def cached_pages_hold_their_tokens(self):
        for h, p in self.pool.cached.items():
            assert self.pool.page_hash[p] == h
            assert self.content[p] == list(self.pool.page_tokens[p])


TestPagePool = PoolMachine.TestCase
TestPagePool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PythonLoopsMachine(PoolMachine):
    OPS = pool_ops.PYTHON                         # the reference loops, whatever the machine has


TestPagePoolPythonLoops = PythonLoopsMachine.TestCase
TestPagePoolPythonLoops.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _state(pool):
    return [list(x) if isinstance(x, (list, array)) else x for x in (
        pool.ref, pool.generation, pool.page_hash, pool.page_tokens, pool.page_index, pool.page_parent,
        pool._prev, pool._next, pool._is_free, dict(pool.cached), pool._head, pool._tail, pool.num_free,
        pool.num_cached_free, pool.num_evictions, pool.free_order())]


def _call(pool, held, op, a, pick):
    """One pool call of a random script; its result, or the error it raised."""
    try:
        if op == "allocate":
            held.append(pool.allocate(min(a[0], pool.num_free), 1))
            return held[-1]
        if op == "free" and held:
            return pool.free(reversed(held.pop(pick % len(held))), 1)
        if op == "register" and held:
            pages = held[pick % len(held)]
            chain = [(hash((a[1], i)), (a[1], i)) for i in range(len(pages))]
            return pool.register_chain(list(pages), chain, a[2], None)
        if op == "walk":
            return pool.walk([(hash((a[1], i)), (a[1], i)) for i in range(5)], a[0])
        if op == "acquire":
            got = [p for p in range(pool.num_pages) if pool.page_hash[p] is not None][:2]
            pool.acquire(got, "shared")
            held.append(got)
            return got
        if op == "bad_free":                     # the second page has no reference left
            used = [p for p in range(pool.num_pages) if pool.ref[p] > 0]
            free = [p for p in range(pool.num_pages) if pool.ref[p] == 0]
            return pool.free(used[:1] + free[:1], "bad")
        if op == "forget":
            return pool.forget(range(0, pool.num_pages, 2))
    except Exception as e:
        return type(e), str(e)
    return None


@pytest.mark.skipif(pool_ops.compiled() is None, reason=f"no compiled pool loops: {pool_ops.unavailable_reason()}")
def test_compiled_loops_match_the_python_ones_call_for_call():
    """The same random script on two pools, one on each implementation: the same results, the
    same events, the same state after every call (errors included)."""
    import random
    ops = ["allocate", "allocate", "free", "register", "walk", "acquire", "bad_free", "forget"]
    for seed in range(60):
        rng = random.Random(seed)
        size = rng.choice([3, 8, 30])
        script = [(rng.choice(ops), (rng.randint(1, 6), rng.randint(0, 6), rng.randint(0, 3)), rng.randint(0, 99))
                  for _ in range(120)]
        runs = []
        for impl in (pool_ops.PYTHON, pool_ops.compiled()):
            pool = PagePool(size, 4)
            pool._ops = impl
            heard, held, trail = [], [], []
            pool.observer = lambda etype, *fields, _h=heard: _h.append((etype, fields))
            for op, a, pick in script:
                trail.append((op, _call(pool, held, op, a, pick), _state(pool)))
            runs.append((trail, heard))
        (trail_py, heard_py), (trail_c, heard_c) = runs
        for i, (x, y) in enumerate(zip(trail_py, trail_c)):
            assert x == y, (seed, i)
        assert heard_py == heard_c


def test_lru_evicts_least_recently_freed_first():
    pool = PagePool(4, PS)
    a = pool.allocate(2, 1)
    pool.register(a[0], 111, tuple(range(PS)))
    pool.free(reversed(a), 1)                   # tail first, as sequences release
    b = pool.allocate(2, 2)                      # untouched pages 2, 3 go before cached ones
    assert sorted(b) == [2, 3] and pool.lookup(111, tuple(range(PS))) == a[0]
    c = pool.allocate(2, 3)
    assert c == [a[1], a[0]] and pool.lookup(111, tuple(range(PS))) is None
    assert pool.num_evictions == 1 and pool.generation[a[0]] == 2


def test_free_pages_and_holders_are_read_only_views():
    pool = PagePool(4, PS)
    a = pool.allocate(2, 1)
    pool.acquire([a[0]], 2)                     # shared: two references, the pool keeps no owner names
    assert pool.free_pages() == (2, 3) and [pool.holders(p) for p in range(4)] == [2, 1, 0, 0]
    pool.free([a[1]], 1)                        # joins the queue's tail
    free = pool.free_pages()
    assert free == tuple(pool.free_order()) == (2, 3, a[1]) and isinstance(free, tuple)
    assert pool.holders(a[1]) == 0 and pool.holders(a[0]) == 2
    with pytest.raises(IndexError, match="outside the pool"):
        pool.holders(4)
    with pytest.raises(IndexError):
        pool.holders(-1)


def test_lookup_is_collision_safe():
    pool = PagePool(2, PS)
    p = pool.allocate(1, 1)[0]
    pool.register(p, 42, tuple([1] * PS))
    assert pool.lookup(42, tuple([2] * PS)) is None       # same hash, other tokens: no hit
    assert pool.lookup(42, tuple([1] * PS)) == p


def test_forget_reports_evictions_and_keeps_counts():
    pool = PagePool(4, PS)
    heard = []
    pool.observer = lambda kind, pages, *fields: heard.append((kind, list(pages)))
    a = pool.allocate(2, 7)
    pool.register(a[0], 1, tuple([1] * PS))
    pool.register(a[1], 2, tuple([2] * PS))
    pool.free([a[1]], 7)                                  # a[1] cached-free, a[0] in use
    assert pool.num_cached_free == 1
    heard.clear()
    assert pool.forget([a[0], a[1], 3]) == [a[0], a[1]]   # page 3 carried no hash
    assert heard == [(PagesEvicted, [a[0], a[1]])]
    assert pool.num_cached_free == 0 and pool.cached == {} and pool.lookup(1, tuple([1] * PS)) is None


def test_pool_reports_typed_events_with_the_owner_of_each_call():
    """Every call names its owner; the observer hears (event type, the event's fields after
    step and t_ns), so each report builds its event directly."""
    pool = PagePool(6, PS)
    events = []
    pool.observer = lambda etype, *fields: events.append(etype(0, 0, *fields))
    a = pool.allocate(2, 11)
    pool.register(a[0], 5, tuple([5] * PS), 0)
    pool.notify_registered([a[0]], [0], 11)
    pool.acquire([a[0]], "reservation")                  # a named owner, not a request
    pool.free(reversed(a), 11)
    pool.free([a[0]], "reservation")
    b = pool.allocate(6, 12)                              # takes the cached page too: evicted first
    assert [type(e) for e in events] == [PagesAllocated, PagesRegistered, PagesShared, PagesFreed, PagesFreed,
                                         PagesEvicted, PagesAllocated]
    alloc, reg, shared, freed, freed2, evicted, alloc2 = events
    assert alloc.pages == tuple(a) and alloc.generations == (1, 1) and alloc.request_id == 11
    assert reg.pages == (a[0],) and reg.page_indices == (0,) and reg.request_id == 11
    assert shared.pages == (a[0],) and shared.request_id == "reservation"
    assert freed.pages == (a[1],) and freed.still_shared == (a[0],) and freed.request_id == 11
    assert freed2.pages == (a[0],) and freed2.cached == (a[0],) and freed2.request_id == "reservation"
    assert evicted.pages == (a[0],) and alloc2.request_id == 12 and set(alloc2.pages) == set(range(6))
    assert set(POOL_EVENTS) == {PagesAllocated, PagesShared, PagesRegistered, PagesFreed, PagesEvicted}
    assert not hasattr(pool, "actor")
    with pytest.raises(TypeError):
        pool.allocate(1)                                  # no owner, no pages: the caller must say whose


def test_register_chain_matches_register_one_by_one():
    import random
    rng = random.Random(4)
    for _ in range(50):
        one, many = PagePool(12, PS), PagePool(12, PS)
        pages = one.allocate(8, 0)
        assert many.allocate(8, 0) == pages
        taken = rng.sample(range(12), 3)                  # some hashes already cached, some pages hashed
        for pool in (one, many):
            for k, p in enumerate(taken[:2]):
                pool.cached[1000 + k] = p
        chain = [(rng.choice([1000, 1001, 2000 + i]), (i,)) for i in range(8)]
        start, parent = rng.randint(0, 3), rng.choice([None, 77])
        want_e, want_i, par = [], [], parent
        for j, (p, (h, key)) in enumerate(zip(pages, chain)):
            if one.register(p, h, key, start + j, par):
                want_e.append(p)
                want_i.append(start + j)
            par = h
        assert many.register_chain(pages, chain, start, parent) == (want_e, want_i)
        for name in ("page_hash", "page_tokens", "page_index", "page_parent", "cached"):
            assert getattr(one, name) == getattr(many, name), name


def test_page_hash_is_the_same_in_every_process():
    """Replays must be reproducible: the chained hash may not depend on the process."""
    import subprocess
    import sys
    from workbench.engine.pages import hash_page
    code = "from workbench.engine.pages import hash_page; print(hash_page(hash_page(None, (1, 2)), (3,)))"
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
           for _ in range(2)}
    assert got == {str(hash_page(hash_page(None, (1, 2)), (3,)))}


def test_hash_chain_is_hash_page_chained_in_both_implementations():
    from workbench.engine.pages import ROOT_HASH, hash_chain, hash_page
    blocks = [(1, 2), (3,), tuple(range(16)), (-1, 7, 0)]
    for parent in (None, 12345):
        want, h = [], parent
        for b in blocks:
            h = hash_page(h, b)
            want.append((h, b))
        assert hash_chain(parent, blocks) == want
        for impl in (pool_ops.PYTHON, pool_ops.compiled()):
            if impl is not None:
                assert impl.hash_chain(ROOT_HASH, parent, blocks) == want, impl.name


def test_without_a_compiler_the_pool_runs_its_python_loops(tmp_path):
    import os
    import subprocess
    import sys
    code = ("from workbench.engine import pool_ops; from workbench.engine.pages import PagePool; "
            "p = PagePool(4, 16); p.free(p.allocate(3, 1), 1); "
            "print(pool_ops.active().name, p._ops.name, p.num_free, '|', pool_ops.unavailable_reason())")
    for env in ({"CC": "false"}, {"PAGEDKV_POOL": "python"}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PAGEDKV_EXTENSIONS_DIR": str(tmp_path), **env}).stdout
        assert out.startswith("python python 4 |"), out
