"""Page pool invariants under hypothesis stateful testing.

A model of the KV contents (which tokens each page slot holds) rides along: a prefix
hit must hand out a page whose contents equal the requesting sequence's tokens.
"""
from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workbench.engine.kv_manager import KVCacheManager, pages_for
from workbench.engine.pages import NoFreePages, PagePool
from workbench.engine.sequence import SamplingParams, Sequence

PS = 16
PREFIXES = [[7] * 40, [7] * 20 + [8] * 20, list(range(50))]


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(4, 40))
    def setup(self, num_pages):
        self.pool = PagePool(num_pages, PS)
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
        n = self.kv.try_admit(seq, lambda cached: min(len(toks) - cached, chunk))
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
            pages = self.pool.allocate(n)
        except NoFreePages:
            return
        for p in pages:
            self.content.pop(p, None)
        self.pool.free(pages)

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


def test_lru_evicts_least_recently_freed_first():
    pool = PagePool(4, PS)
    a = pool.allocate(2)
    pool.register(a[0], 111, tuple(range(PS)))
    pool.free(reversed(a))                      # tail first, as sequences release
    b = pool.allocate(2)                         # untouched pages 2, 3 go before cached ones
    assert sorted(b) == [2, 3] and pool.lookup(111, tuple(range(PS))) == a[0]
    c = pool.allocate(2)
    assert c == [a[1], a[0]] and pool.lookup(111, tuple(range(PS))) is None
    assert pool.num_evictions == 1 and pool.generation[a[0]] == 2


def test_lookup_is_collision_safe():
    pool = PagePool(2, PS)
    p = pool.allocate(1)[0]
    pool.register(p, 42, tuple([1] * PS))
    assert pool.lookup(42, tuple([2] * PS)) is None       # same hash, other tokens: no hit
    assert pool.lookup(42, tuple([1] * PS)) == p


def test_forget_reports_evictions_and_keeps_counts():
    pool = PagePool(4, PS)
    heard = []
    pool.observer = lambda kind, pages, **d: heard.append((kind, list(pages)))
    a = pool.allocate(2)
    pool.register(a[0], 1, tuple([1] * PS))
    pool.register(a[1], 2, tuple([2] * PS))
    pool.free([a[1]])                                     # a[1] cached-free, a[0] in use
    assert pool.num_cached_free == 1
    heard.clear()
    assert pool.forget([a[0], a[1], 3]) == [a[0], a[1]]   # page 3 carried no hash
    assert heard == [("evicted", [a[0], a[1]])]
    assert pool.num_cached_free == 0 and pool.cached == {} and pool.lookup(1, tuple([1] * PS)) is None


def test_page_hash_is_the_same_in_every_process():
    """Replays must be reproducible: the chained hash may not depend on the process."""
    import subprocess
    import sys
    from workbench.engine.pages import hash_page
    code = "from workbench.engine.pages import hash_page; print(hash_page(hash_page(None, (1, 2)), (3,)))"
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
           for _ in range(2)}
    assert got == {str(hash_page(hash_page(None, (1, 2)), (3,)))}
