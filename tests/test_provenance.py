"""probes/provenance.py on hand-made histories: the digest chain, a hit checked against what the
block was filled with, and the first differing position named."""
from __future__ import annotations

import zlib

import numpy as np

from probes.provenance import ProvenanceLedger, chain, seed


def test_chain_covers_every_token_before_the_block_end():
    toks = list(range(100, 140))
    d = chain(toks, 8, 5)
    assert len(d) == 5 and chain(toks, 8, 3) == d[:3]
    raw = np.asarray(toks[:16], dtype=np.int32).tobytes()
    assert d[1] == zlib.crc32(raw[32:], zlib.crc32(raw[:32]))
    other = list(toks)
    other[3] = 7                                            # an early token changes every later digest
    assert all(a != b for a, b in zip(chain(other, 8, 5), d))
    assert chain(toks, 8, 9) == d                           # only whole blocks
    # resuming a chain from its last digest gives the same as one pass
    assert chain(toks[16:], 8, 3, d[1]) == d[2:]
    assert seed(("lora-a", None)) != seed(("lora-b", None)) and seed(()) == 0


def test_a_hit_on_a_block_filled_for_another_history_names_the_position_and_the_filler():
    bs = 8
    led = ProvenanceLedger(bs)
    a = list(range(1000, 1024))
    for j, dg in enumerate(chain(a, bs, 3)):
        led.fill(40 + j, j, dg, a, "a")
    assert led.check_hit("b", [40, 41], a, chain(a, bs, 2)) is None      # the same history: fine
    b = list(a)
    b[13] = 5                                               # block 1 differs at position 13
    m = led.check_hit("b", [40, 41], b, chain(b, bs, 2))
    assert (m.request, m.block, m.index, m.position, m.filled_for) == ("b", 41, 1, 13, "a")
    # the same tokens under another cache salt: only the extra keys differ
    m = led.check_hit("c", [40], a, chain(a, bs, 1, seed(("salt",))))
    assert m.position == -1 and m.block == 40
    # a block served at another index than it was filled at
    m = led.check_hit("d", [41], a[8:], chain(a[8:], bs, 1))
    assert m.recorded_index == 1 and m.index == 0 and m.position == 0


def test_stalled_names_who_waited_long_with_room_longest_first():
    from probes.progress import stalled
    waiting = {"a": (10, 4), "b": (0, 4), "c": (0, 900), "d": (95, 1)}
    assert stalled(100, waiting, free_blocks=500, after=64) == [("b", 100, 4), ("a", 90, 4)]
    assert stalled(100, waiting, free_blocks=3, after=64) == []       # no room: waiting is fair
