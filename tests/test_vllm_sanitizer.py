"""The vLLM plugin's checks (workbench/adapters/vllm/sanitizer.py) on hand-built arrays, no vLLM.

The batch and the pool are written out by hand, as vLLM would hold them, so the reference
the checks rebuild is compared with numbers worked out here, not with its own output."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.adapters.vllm.sanitizer import HINTS, PROBE_METADATA, PROBE_POOL, metadata_findings, pool_findings

# ---- a batch of three requests, block_size 4 ----------------------------------------------
#   a: prefill, 0 computed, 6 scheduled -> context 6,  blocks [3, 7]
#   b: decode,  9 computed, 1 scheduled -> context 10, blocks [5, 11, 2]
#   c: chunk,   4 computed, 5 scheduled -> context 9,  blocks [8, 9, 12, 13] (13 allocated ahead)
BS, NUM_BLOCKS = 4, 32
REQS = ["a", "b", "c"]
STARTS, Q = [0, 9, 4], [6, 1, 5]
PAGES = [[3, 7], [5, 11, 2], [8, 9, 12, 13]]
QSL = [0, 6, 7, 12]
SEQ_LENS = [6, 10, 9]
POSITIONS = [0, 1, 2, 3, 4, 5,   9,   4, 5, 6, 7, 8]
# slot = block * 4 + offset: a's positions 0-3 in block 3, 4-5 in block 7; b's 9 in block 2;
# c's 4-7 in block 9, 8 in block 12
SLOTS = [12, 13, 14, 15, 28, 29,   9,   36, 37, 38, 39, 48]
TABLE = [[3, 7, 0, 0, 0, 0],          # vLLM's block_table_tensor: padded with 0 past each row
         [5, 11, 2, 0, 0, 0],
         [8, 9, 12, 13, 0, 0]]


def check(**tensors):
    t = {"query_start_loc": QSL, "seq_lens": SEQ_LENS, "block_table": TABLE, "slot_mapping": SLOTS,
         "positions": POSITIONS}
    t.update(tensors)
    t = {k: None if v is None else np.asarray(v, dtype=np.int32) for k, v in t.items()}
    return metadata_findings(7, REQS, STARTS, Q, PAGES, BS, NUM_BLOCKS, **t)


def test_correct_batch_has_no_findings():
    assert check() == []
    assert check(positions=None, slot_mapping=None) == []
    # a wider table (vLLM's is max_num_blocks_per_req wide) and garbage past each row's context
    wide = np.zeros((3, 64), np.int32)
    wide[:, :6] = TABLE
    wide[0, 2:] = 31                           # a reads 2 blocks; what lies after is not read
    assert check(block_table=wide) == []


def test_permuted_entries_in_one_row_name_its_request_and_block():
    bt = np.array(TABLE)
    bt[2, [1, 2]] = bt[2, [2, 1]]             # c's row reads [8, 12, 9, 13]
    (f,) = check(block_table=bt)
    assert f["kind"] == "block-table" and f["probe"] == PROBE_METADATA and f["severity"] == "error"
    assert f["request_id"] == "c" and f["page"] == 12 and f["step"] == 7
    assert f["evidence"]["got"] == 12 and f["evidence"]["want"] == 9 and f["evidence"]["index"] == 1
    assert "row 2 column 1 holds 12, request c means 9" in f["message"]
    assert f["hint"] == HINTS["block-table"]


def test_swapped_rows_name_the_first_request_and_list_both():
    bt = np.array(TABLE)
    bt[[0, 1]] = bt[[1, 0]]                   # faults.py's permuted_block_table_rows
    (f,) = check(block_table=bt)
    assert f["kind"] == "block-table" and f["request_id"] == "a" and f["page"] == 5
    assert f["evidence"]["requests"] == ["a", "b"] and "2 requests affected: a, b" in f["message"]


def test_block_id_outside_the_pool_is_a_block_table_finding():
    bt = np.array(TABLE)
    bt[1, 2] = NUM_BLOCKS + 5
    (f,) = check(block_table=bt)
    assert f["kind"] == "block-table" and f["request_id"] == "b" and f["evidence"]["got"] == NUM_BLOCKS + 5


def test_slot_one_block_off_at_a_boundary_names_request_and_token():
    slots = np.array(SLOTS)
    slots[7] += BS                             # c's position 4, the first token of its 2nd block
    (f,) = check(slot_mapping=slots)
    assert f["kind"] == "slot-mapping" and f["request_id"] == "c"
    assert f["evidence"]["index"] == 7 and f["evidence"]["got"] == 40 and f["evidence"]["want"] == 36
    assert "token 7 (position 4 of row 2) holds 40, request c means 36" in f["message"]


def test_the_boundary_fault_on_every_request():
    pos = np.array(POSITIONS)
    slots = np.array(SLOTS)
    edge = (pos % BS == 0) & (pos > 0)         # exactly what faults.slot_mapping_off_at_boundary does
    slots[edge] += BS
    (f,) = check(slot_mapping=slots)
    assert f["kind"] == "slot-mapping" and f["request_id"] == "a" and f["evidence"]["index"] == 4
    assert f["evidence"]["requests"] == ["a", "c"]     # b's token (position 9) is not at a boundary


def test_slot_mapping_finding_names_the_block_the_slot_is_in():
    slots = np.array(SLOTS)
    slots[7] += BS
    (f,) = check(slot_mapping=slots)
    assert f["page"] == 40 // BS


def test_query_start_loc_off_by_one_is_a_lengths_finding():
    qsl = np.array(QSL)
    qsl[2] += 1                                 # b's end (and c's start) one token late
    (f,) = check(query_start_loc=qsl)
    assert f["kind"] == "lengths" and f["evidence"]["copy"] == "query_start_loc"
    assert f["request_id"] == "b" and f["page"] is None
    assert "query_start_loc entry 2 holds 8, request b means 7" in f["message"]


def test_seq_lens_off_by_one_is_a_lengths_finding():
    sl = np.array(SEQ_LENS)
    sl[0] -= 1
    (f,) = check(seq_lens=sl)
    assert f["kind"] == "lengths" and f["evidence"]["copy"] == "seq_lens" and f["request_id"] == "a"


def test_positions_off_names_the_request():
    pos = np.array(POSITIONS)
    pos[6] = 10
    kinds = {f["kind"]: f for f in check(positions=pos)}
    assert set(kinds) == {"positions"} and kinds["positions"]["request_id"] == "b"


# ---- the block pool: 10 blocks, block 0 vLLM's null block ---------------------------------
#   a maps [1, 2, 3], b maps [3, 4] (block 3 shared: ref 2); 5..9 free, queued 7, 5, 9, 6, 8
N = 10


def links(walk):
    prev = [-1] * N
    for x, y in zip(walk, walk[1:]):
        prev[y] = x
    return prev


def pool(**over):
    walk = over.pop("walk", [7, 5, 9, 6, 8])
    kw = {"step": 11, "ref": [0, 1, 1, 2, 1, 0, 0, 0, 0, 0], "free_walk": walk, "walk_error": None,
          "prev": links(walk), "num_free": len(walk), "null_block": 0,
          "holders": {"a": [1, 2, 3], "b": [3, 4]}, "live": {"a": "RUNNING", "b": "RUNNING"},
          "index_errors": ([], []), "last_holder": {1: "a", 2: "a", 3: "b", 4: "b"},
          "block_size": 4, "computed": {"a": 12, "b": 7}}
    kw.update(over)
    return pool_findings(**kw)


def test_consistent_pool_has_no_findings():
    assert pool() == []
    assert pool(ref=np.array([0, 1, 1, 2, 1, 0, 0, 0, 0, 0], np.int32)) == []


def test_the_null_block_is_not_reported():
    # block 0: ref_cnt 0, never on the free queue; and mapped by a (a sliding-window style entry)
    assert pool(holders={"a": [0, 1, 2, 3], "b": [3, 4]}) == []
    assert pool(ref=[1, 1, 1, 2, 1, 0, 0, 0, 0, 0]) == []
    # the exemption is what hides it: the same pool without it says block 0 is lost
    (f,) = pool(null_block=None)
    assert f["kind"] == "lost" and f["page"] == 0


def test_a_block_with_a_reference_that_nobody_maps_is_a_leak_naming_the_last_holder():
    # c finished (gone from live and the holders) but its block 6 kept ref_cnt 1 off the free queue
    ref = [0, 1, 1, 2, 1, 0, 1, 0, 0, 0]
    (f,) = pool(ref=ref, walk=[7, 5, 9, 8], last_holder={1: "a", 2: "a", 3: "b", 4: "b", 6: "c"})
    assert f["kind"] == "leak" and f["probe"] == PROBE_POOL and f["severity"] == "error"
    assert f["request_id"] == "c" and f["page"] == 6 and f["evidence"]["pages"] == [6]
    assert "last held by request c" in f["message"] and f["hint"] == HINTS["leak"]


def test_a_request_gone_from_the_scheduler_that_still_holds_blocks_is_an_orphan():
    ref = [0, 1, 1, 2, 1, 0, 1, 0, 0, 0]
    (f,) = pool(ref=ref, walk=[7, 5, 9, 8], holders={"a": [1, 2, 3], "b": [3, 4], "c": [6]})
    assert f["kind"] == "orphan" and f["request_id"] == "c" and f["page"] == 6
    assert "request c is no longer scheduled but still holds 1 blocks" in f["message"]


def test_ref_1_with_two_holders_is_a_refcount_finding():
    (f,) = pool(ref=[0, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    assert f["kind"] == "refcount" and f["page"] == 3 and f["request_id"] == "a"
    assert f["evidence"] == {"ref_cnt": 1, "mapped": 2, "may_have_freed": 0, "requests": ["a", "b"]}
    assert "block 3 has ref_cnt 1 but 2 requests still read it: a, b" in f["message"]


@pytest.mark.parametrize("num_free", [4, 5], ids=["counter-agrees", "counter-counts-it"])
def test_a_free_queue_missing_a_ref_0_block(num_free):
    out = pool(walk=[7, 5, 6, 8], num_free=num_free)       # block 9: ref 0, yet not on the queue
    kinds = {f["kind"] for f in out}
    assert kinds & {"lost", "queue"} and kinds <= {"lost", "queue", "counts"}, out
    lost = [f for f in out if f["kind"] == "lost"]
    assert lost and lost[0]["page"] == 9 and lost[0]["evidence"]["pages"] == [9]
    assert ("counts" in kinds) == (num_free == 5)


def test_broken_free_queue_links_are_a_queue_finding():
    walk = [7, 5, 9, 6, 8]
    prev = links(walk)
    prev[6] = 5                                  # 9 -> 6, but 6 says it follows 5
    (f,) = pool(prev=prev)
    assert f["kind"] == "queue" and f["evidence"]["pages"] == [9, 6]


def test_a_running_request_short_of_blocks():
    (f,) = pool(computed={"a": 13, "b": 7})
    assert f["kind"] == "short" and f["request_id"] == "a"
