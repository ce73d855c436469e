"""The peer of replay_speed.py: nano-vllm-style bare scheduling of a trace, no events, no model.

A Scheduler + BlockManager loop in the manner of nano-vllm (a block table per sequence,
ref counts, hash -> block for prefix caching, a free list reused oldest first), written as
tight as plain Python allows and with the same policy as the workbench's simulator: a token
budget per step, running sequences first (chunked prefill, decode), preemption of the
latest admitted when a page is short, FCFS admission after a cached-prefix lookup, the same
page keys and chained hashes, the same virtual clock and arrivals. What it leaves out is
what the simulator adds: events (every one recorded), per-step pool timeline, probes'
hooks, the engine-shaped API.

    from bare_loop import bare_replay
    steps, preemptions, hit_rate = bare_replay(trace.records, page_size=16, num_pages=65536)
"""
from __future__ import annotations

from collections import OrderedDict, deque

ROOT_HASH = 0x5EED_CAFE


class _Seq:
    __slots__ = ("plen", "max_len", "ntok", "computed", "blocks", "chain", "n_hashed", "rid", "hash_ids", "hblock")

    def __init__(self, rid, plen, n_out, hash_ids, hblock, cap):
        self.rid, self.plen, self.hash_ids, self.hblock = rid, plen, hash_ids, hblock
        self.ntok, self.computed, self.max_len = plen, 0, min(cap, plen + n_out)
        self.blocks: list[int] = []
        self.chain: list[tuple[int, tuple]] = []    # (chained hash, key) per full block, memoised
        self.n_hashed = 0                           # blocks registered in the prefix cache

    def hashes_to(self, n: int, bs: int) -> list:
        chain = self.chain
        h = chain[-1][0] if chain else ROOT_HASH
        for i in range(len(chain), n):
            s = i * bs
            if self.hash_ids and s + bs <= self.plen:
                b0, b1 = s // self.hblock, (s + bs - 1) // self.hblock
                key = (self.hash_ids[b0], s - b0 * self.hblock) if b0 == b1 else \
                    (self.hash_ids[b0], s - b0 * self.hblock, self.hash_ids[b1])
            else:
                key = (-1, self.rid, i)
            h = hash((h, key))
            chain.append((h, key))
        return chain


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list = [None] * num_blocks
        self.block_key: list = [None] * num_blocks
        self.hash_to_block: dict = {}
        self.free = OrderedDict.fromkeys(range(num_blocks))     # oldest freed first

    def match(self, seq: _Seq) -> list[int]:
        n = (seq.ntok - 1) // self.bs
        out = []
        for h, key in seq.hashes_to(n, self.bs)[:n]:
            b = self.hash_to_block.get(h)
            if b is None or self.block_key[b] != key:
                break
            out.append(b)
        return out

    def take(self, seq: _Seq, hits: list[int], need: int) -> None:
        ref, free = self.ref, self.free
        for b in hits:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
        blocks = seq.blocks = list(hits)
        seq.n_hashed = len(hits)
        self.grow(seq, need)

    def grow(self, seq: _Seq, need: int) -> None:
        ref, free, bh, h2b = self.ref, self.free, self.block_hash, self.hash_to_block
        blocks = seq.blocks
        for _ in range(need):
            b = free.popitem(last=False)[0]
            h = bh[b]
            if h is not None:
                if h2b.get(h) == b:
                    del h2b[h]
                bh[b] = self.block_key[b] = None
            ref[b] = 1
            blocks.append(b)

    def release(self, seq: _Seq) -> None:
        ref, free = self.ref, self.free
        for b in reversed(seq.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        seq.blocks = []
        seq.n_hashed = 0

    def register(self, seq: _Seq) -> None:
        n = min(seq.computed // self.bs, len(seq.blocks))
        if n <= seq.n_hashed:
            return
        chain = seq.hashes_to(n, self.bs)
        bh, bk, h2b = self.block_hash, self.block_key, self.hash_to_block
        for i in range(seq.n_hashed, n):
            b = seq.blocks[i]
            h, key = chain[i]
            if bh[b] is None and h not in h2b:
                h2b[h], bh[b], bk[b] = b, h, key
        seq.n_hashed = n


def bare_replay(records, page_size: int = 16, num_pages: int = 65536, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 16384, watermark: float = 0.01, per_step_s: float = 0.008,
                per_token_s: float = 0.00002):
    """Replay the records (arrival_s, prompt_len, output_len, hash_ids, hash_block_size); returns
    (steps, preemptions, prefix hit rate)."""
    bs = page_size
    bm = BlockManager(num_pages, bs)
    waiting: deque[_Seq] = deque()
    running: list[_Seq] = []
    clock, nxt, steps, preemptions, queries, hits_total = 0.0, 0, 0, 0, 0, 0
    wm = int(watermark * num_pages)
    n_rec = len(records)
    while nxt < n_rec or waiting or running:
        if nxt < n_rec:
            if not (waiting or running):
                clock = max(clock, records[nxt].arrival_s)
            while nxt < n_rec and records[nxt].arrival_s <= clock:
                r = records[nxt]
                if -(-(r.prompt_len + 1) // bs) <= num_pages:
                    waiting.append(_Seq(nxt, r.prompt_len, max(1, r.output_len), r.hash_ids,
                                        r.hash_block_size if r.hash_ids else 0, num_pages * bs))
                nxt += 1
        steps += 1
        budget, scheduled, preempted = max_num_batched_tokens, [], False
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n = min(s.ntok - s.computed, budget)
            need = -(-(s.computed + n) // bs) - len(s.blocks)
            while need > len(bm.free):                 # preempt the latest admitted (recompute)
                v = running.pop()
                bm.release(v)
                v.computed = 0
                waiting.appendleft(v)
                preemptions += 1
                preempted = True
                if v is s:
                    break
            else:
                if need > 0:
                    bm.grow(s, need)
                scheduled.append((s, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            while waiting and budget > 0 and len(running) < max_num_seqs:
                s = waiting[0]
                hits = bm.match(s)
                cached = len(hits) * bs
                n = min(s.ntok - cached, budget)
                need = -(-(cached + n) // bs) - len(hits)
                revived = sum(1 for b in hits if bm.ref[b] == 0)
                if len(bm.free) - revived < need + (wm if running else 0):
                    break
                waiting.popleft()
                bm.take(s, hits, need)
                s.computed = cached
                queries += s.ntok
                hits_total += cached
                running.append(s)
                scheduled.append((s, n))
                budget -= n
        n_tok = 0
        for s, n in scheduled:
            n_tok += n
            s.computed += n
            bm.register(s)
            if s.computed == s.ntok:
                s.ntok += 1
                if s.ntok >= s.max_len:
                    running.remove(s)
                    bm.release(s)
        if scheduled:
            clock += per_step_s + per_token_s * n_tok
    return steps, preemptions, hits_total / max(1, queries)


if __name__ == "__main__":          # `make bench` runs every script: the peer alone, on the whole trace
    import time

    from workbench.data import mooncake_full
    from workbench.trace import read_trace
    path = mooncake_full()
    if path is None:
        raise SystemExit("bare_loop: the Mooncake trace is not beside this checkout (../shared/traces)")
    recs = read_trace(path).records
    t = time.perf_counter()
    steps, pre, hit = bare_replay(recs)
    print(f"bare loop: {len(recs)} requests, {steps} steps, {pre} preemptions, prefix hit {hit:.1%} "
          f"in {time.perf_counter() - t:.1f} s")
