"""KVCacheManager: gives sequences pages from the pool, on demand and with prefix sharing.

Pages are taken only for tokens being computed in this step, so pages used ==
sum(ceil(tokens / page_size)) over live sequences: nothing reserved for max_len
(field note: contiguous max-length reservation left 74% unused).
"""
from __future__ import annotations

import operator

from .pages import PagePool, hash_chain
from .sequence import Sequence


_first = operator.itemgetter(0)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVCacheManager:
    # Fault seams: `try_admit` (an admission rule that refuses: admission_refuses_long_prompts).
    FAULT_SEAMS = frozenset({"try_admit"})

    def __init__(self, pool: PagePool, enable_prefix_caching: bool = True):
        self.pool = pool
        self.page_size = pool.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0     # prompt tokens looked up (tokens, as vLLM counts)
        self.prefix_cache_hits = 0        # of those, found cached

    def find_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached pages (and their hashes) for the longest full-page prefix of seq.

        The last token is never served from cache: it must be computed to sample from.
        """
        if not self.enable_prefix_caching:
            return [], []
        n = (seq.num_tokens - 1) // self.page_size
        if seq.params.prompt_logprobs:          # rows from prompt_logprobs_from - 1 on must be computed
            n = min(n, (seq.params.prompt_logprobs_from - 1) // self.page_size)
        if n <= 0:
            return [], []
        memo = seq.hash_chain
        if len(memo) < n:
            self.chain(seq, n - 1)                                # extend the memo once, then walk it
        return self.pool.walk(memo, n)

    def chain(self, seq: Sequence, i: int) -> tuple[int, tuple]:
        """(chained hash, content key) of seq's page i, memoised on the sequence: a request
        waiting for pages is looked up again every step, and its hashes never change."""
        memo = seq.hash_chain
        j = len(memo)
        if j <= i:
            ps = self.page_size
            memo.extend(hash_chain(memo[-1][0] if memo else None, seq.page_keys(j, seq.pages_known(i, ps), ps)))
        return memo[i]

    def try_admit(self, seq: Sequence, budget: int, reserve_pages: int = 0) -> int:
        """Map seq's cached prefix and allocate pages for its first chunk: the rest of its
        tokens after the cached prefix, at most budget of them.

        Returns the number of tokens to compute this step, or 0 (and changes nothing) when
        the pool cannot hold them plus reserve_pages.
        """
        pool, ps, total = self.pool, self.page_size, seq.num_tokens
        # The best case first, without walking the prefix cache: every full page before the
        # last token is a hit (h_max of them). The pages needed only shrink as hits grow, so if
        # even that does not fit, nothing does; a head-of-line request waiting for a full pool is asked
        # again every step, and this keeps that to a few integer operations.
        h_max = (total - 1) // ps if self.enable_prefix_caching else 0
        if pool.num_free < pages_for(min(total, h_max * ps + budget), ps) - h_max + reserve_pages:
            return 0
        hit_pages, hit_hashes = self.find_prefix(seq)
        num_cached = len(hit_pages) * ps
        num_new = min(total - num_cached, budget)
        if num_new <= 0:
            return 0
        need = pages_for(num_cached + num_new, ps) - len(hit_pages)
        revived = pool.count_free(hit_pages)                           # hits that leave the free queue
        if pool.num_free - revived < need + reserve_pages:
            return 0
        rid = seq.request_id
        pool.acquire(hit_pages, rid)
        new, gens = pool.allocate_with_generations(need, rid)
        seq.pages = hit_pages + new
        seq.page_generations = list(map(pool.generation.__getitem__, hit_pages)) + gens
        seq.page_hashes = hit_hashes
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        return num_new

    def allocate_fresh(self, seq: Sequence) -> None:
        """Pages for every token of seq, none from the prefix cache (a scoring pass computes every
        row). NoFreePages, changing nothing, when the pool cannot hold them."""
        pages, gens = self.pool.allocate_with_generations(pages_for(seq.num_tokens, self.page_size), seq.request_id)
        seq.pages, seq.page_generations = pages, gens
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Allocate the pages seq needs to compute num_new_tokens more; False if the pool is short."""
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.page_size) - len(seq.pages)   # pages_for
        if need <= 0:
            return True
        pool = self.pool
        if need > pool.num_free:
            return False
        new, gens = pool.allocate_with_generations(need, seq.request_id)
        seq.pages.extend(new)
        seq.page_generations.extend(gens)
        return True

    def release(self, seq: Sequence) -> None:
        """Return seq's pages, tail first; shared and cached pages survive for others."""
        if seq.pages:
            self.pool.free(reversed(seq.pages), seq.request_id)
        seq.pages = []
        seq.page_generations = []
        seq.page_hashes = []

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register each newly completed page under its chained hash."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        hashes = seq.page_hashes
        done = len(hashes)
        if num_full <= done:                         # most steps: a decode that filled no page
            return
        memo = seq.hash_chain
        if len(memo) < num_full:
            self.chain(seq, num_full - 1)
        new = memo[done:num_full]
        hashes.extend(map(_first, new))
        entered, indices = self.pool.register_chain(seq.pages[done:num_full], new, done,
                                                    memo[done - 1][0] if done else None)
        if entered:
            self.pool.notify_registered(entered, indices, seq.request_id)
