"""Prefix provenance: what token history each cached block holds K/V for, recorded by us.

A prefix-cache hit is decided by the engine's own block hash. If that hash is wrong (it forgets
a token, the cache salt, a LoRA, its parent), the hit serves K/V computed for another history
and every check against the engine's own bookkeeping passes. This record is independent of it:
when a block is filled, its digest (CRC32 chained over the token ids from position 0 through the
block's end, seeded with the extra keys that change K/V: LoRA, multimodal hashes, cache salt)
and its own tokens are kept; when a request gets a hit on that block, the requester's own digest
at that block must equal the recorded one. A mismatch names the requester, the block, the first
differing token position and the request the block was filled for.

Plain functions and one class over token lists: the vLLM plugin (engine side) and our engine's
probes use the same code. Memory: 8 bytes + the block's tokens (int32) per recorded block.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np


def seed(extra=()) -> int:
    """The digest's starting value: the extra keys that change a block's K/V (sorted, as text)."""
    return zlib.crc32(repr(tuple(str(x) for x in extra if x is not None)).encode()) if extra else 0


def chain(tokens, block_size: int, num_blocks: int, start: int = 0) -> list[int]:
    """Digests of blocks 0..num_blocks-1: each covers every token from position 0 to its end."""
    arr = np.ascontiguousarray(np.asarray(tokens[: num_blocks * block_size], dtype=np.int32))
    mv, step, crc, out = memoryview(arr).cast("B"), block_size * 4, start, []
    for j in range(min(num_blocks, len(arr) // block_size)):
        crc = zlib.crc32(mv[j * step:(j + 1) * step], crc)
        out.append(crc)
    return out


@dataclass
class Record:
    digest: int
    index: int             # the block's position in the request it was filled for
    filled_for: str
    tokens: bytes          # the block's own token ids (int32), to name the first differing position


@dataclass
class Mismatch:
    request: str
    block: int
    index: int             # where the requester holds the block
    position: int          # first token position whose history differs (-1: only the extra keys differ)
    filled_for: str
    recorded_index: int


class ProvenanceLedger:
    def __init__(self, block_size: int, max_records: int = 2_000_000):
        self.bs = block_size
        self.max_records = max_records
        self.rec: dict[int, Record] = {}
        self.filled = 0
        self.hits_checked = 0

    def fill(self, block: int, index: int, digest: int, tokens, request: str) -> None:
        """Block `block` now holds K/V for `request`'s history through the end of block `index`."""
        if len(self.rec) >= self.max_records and block not in self.rec:
            self.rec.pop(next(iter(self.rec)))            # bounded: the oldest record goes
        blk = np.asarray(tokens[index * self.bs:(index + 1) * self.bs], dtype=np.int32).tobytes()
        self.rec[block] = Record(digest, index, request, blk)
        self.filled += 1

    def check_hit(self, request: str, blocks, tokens, digests) -> Mismatch | None:
        """A hit on `blocks` (the requester's blocks 0..k-1) against the records; the first mismatch."""
        for j, (b, d) in enumerate(zip(blocks, digests)):
            r = self.rec.get(int(b))
            if r is None:
                continue                                  # filled before we watched: nothing to say
            self.hits_checked += 1
            if r.digest == d and r.index == j:
                continue
            return Mismatch(request, int(b), j, self._first_difference(blocks, tokens, j), r.filled_for, r.index)
        return None

    def _first_difference(self, blocks, tokens, j: int) -> int:
        """The first position, in blocks 0..j, where the requester's tokens differ from what the
        blocks were filled with (-1: the tokens agree, so the extra keys or the index differ)."""
        for i in range(j + 1):
            r = self.rec.get(int(blocks[i]))
            if r is None:
                continue
            own = np.asarray(tokens[i * self.bs:(i + 1) * self.bs], dtype=np.int32)
            got = np.frombuffer(r.tokens, dtype=np.int32)
            n = min(len(own), len(got))
            diff = np.nonzero(own[:n] != got[:n])[0]
            if len(diff) or r.index != i:
                return i * self.bs + (int(diff[0]) if len(diff) else 0)
        return -1
