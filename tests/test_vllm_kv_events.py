"""vLLM's KV cache events, followed over real ZMQ on 127.0.0.1 (no vLLM needed).

FakeVLLM reproduces vLLM 0.32's ZmqEventPublisher on the wire: frames (topic, seq as 8
bytes big-endian, msgpack [ts, [event maps], dp_rank]), seq from 0 per publisher, the
bind-or-connect rule, and the ROUTER replay server over its last buffer_steps batches.
It publishes through an XPUB rather than a PUB: the same bytes on the wire, and the
XPUB hands over the subscriber's subscription, so a test knows the subscriber is
listening before it publishes (no slow-joiner sleep)."""
import socket
import threading
import time
from collections import deque

import msgpack
import pytest
import zmq
from vllm_fakes import wait_until

from workbench.adapters.vllm.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventFormatError,
                                               KVEventSubscriber, StoredBlock, decode_batch, vllm_binds)

pytestmark = pytest.mark.timeout(60)
BS = 4

# A KVEventBatch(ts=1.5, [BlockStored([1, 2**63 + 5], None, range(32), 16, None, "GPU", None),
# BlockRemoved([b"ab"], "GPU"), AllBlocksCleared()], data_parallel_rank=0) as vLLM 0.32's
# msgspec encoder wrote it: the decoder is held against the real bytes, not our own packing.
VLLM_PAYLOAD = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201"
    "cf8000000000000005b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102"
    "030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f"
    "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f"
    "766564ac626c6f636b5f68617368657391c4026162a66d656469756da347505581a474797065b0416c6c426c"
    "6f636b73436c656172656400")


# ---- a stand-in for vLLM's publisher -------------------------------------------------
class FakeVLLM:
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, replay=False, buffer_steps=10_000, topic=""):
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.seq = 0
        self.buffer = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.pub = None
        self.replay_endpoint = None
        self.replay_requests = []
        self._stop = threading.Event()
        self._thread = None
        if replay:      # vLLM always binds its replay ROUTER
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.linger = 0
            self.router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def open_pub(self, endpoint):
        """vLLM's PUB, bound or connected by vLLM's rule."""
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        if vllm_binds(endpoint):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        return self

    def wait_subscribed(self, timeout=5.0):
        """The subscriber's subscription arrived: what it is sent from now on, it gets."""
        assert self.pub.poll(int(timeout * 1000)), "the subscriber never subscribed"
        assert self.pub.recv()[:1] == b"\x01"

    def publish(self, events, send=True):
        """Publish one batch (seq assigned as vLLM does); send=False: buffered, lost on the wire."""
        return self.publish_raw(msgpack.packb([time.time(), events, 0]), send)

    def publish_raw(self, payload, send=True):
        seq, self.seq = self.seq, self.seq + 1
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replay(self):
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, empty, start = self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            with self.lock:
                batches = list(self.buffer)
            for seq, payload in batches:
                if seq >= start:
                    self.router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join()
            self.router.close()
        if self.pub is not None:
            self.pub.close()
        self.ctx.term()


def stored(hashes, parent=None, n_tokens=None):
    n_tokens = len(hashes) * BS if n_tokens is None else n_tokens
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(range(n_tokens)), "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0}


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}


def expected_map(batches):
    """An independent model of the map: {hash: parent} after these batches of event maps."""
    m = {}
    for events in batches:
        for e in events:
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                for h in e["block_hashes"]:
                    m.setdefault(h, parent)
                    parent = h
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    m.pop(h, None)
            elif e["type"] == "AllBlocksCleared":
                m.clear()
    return m



def parents(sub):
    return {h: b.parent for h, b in sub.stored.items()}


@pytest.fixture
def tcp_pair(request):
    """A subscriber bound on tcp://127.0.0.1:<free port> and a FakeVLLM connected to it (vLLM's
    default shape: its PUB connects to a non-wildcard tcp endpoint). Yields a factory."""
    made = []

    def make(replay=True, buffer_steps=10_000, replay_endpoint=None, replay_timeout_s=1.0, **kw):
        vllm = FakeVLLM(replay=replay, buffer_steps=buffer_steps)
        sub = KVEventSubscriber("tcp://127.0.0.1:0", replay_endpoint=replay_endpoint or vllm.replay_endpoint,
                                poll_ms=20, replay_timeout_s=replay_timeout_s, **kw).start()
        made.append((sub, vllm))
        vllm.open_pub(sub.address).wait_subscribed()
        return sub, vllm

    yield make
    for sub, vllm in made:
        sub.close()
        if not vllm.ctx.closed:
            vllm.close()


# ---- decoding ------------------------------------------------------------------------
def test_decodes_vllms_own_encoding():
    b = decode_batch(3, VLLM_PAYLOAD)
    assert (b.seq, b.ts, b.dp_rank) == (3, 1.5, 0)
    st, rm, cl = b.events
    assert isinstance(st, BlockStored) and st.block_hashes == [1, 2**63 + 5] and st.parent_block_hash is None
    assert st.token_ids == list(range(32)) and st.block_size == 16 and st.medium == "GPU"
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == [b"ab"]      # bytes hashes, too
    assert isinstance(cl, AllBlocksCleared)


def test_decode_errors_name_seq_and_field():
    cases = [
        (b"\xc1", "payload is not msgpack"),
        (msgpack.packb({"ts": 1}), "expected an array [ts, events, data_parallel_rank]"),
        (msgpack.packb(["x", [], 0]), "ts is 'x'"),
        (msgpack.packb([1.0, [stored([1]) | {"block_size": "4"}], 0]), "events[0].block_size is '4' (str)"),
        (msgpack.packb([1.0, [removed([1]), removed([2, 3.5])], 0]), "events[1].block_hashes[1] is 3.5"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}], 0]), "events[0] is"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 4}], 0]),
         "events[0].token_ids is missing"),
    ]
    for payload, words in cases:
        with pytest.raises(KVEventFormatError) as e:
            decode_batch(41, payload)
        assert str(e.value).startswith("KV event batch 41: ") and words in str(e.value), str(e.value)
    # optional keys may be absent (omit_defaults), and a trailing data_parallel_rank too
    b = decode_batch(0, msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [7]}]]))
    assert b.dp_rank is None and b.events[0].medium is None


# ---- live bookkeeping ----------------------------------------------------------------
def test_stored_removed_cleared(tcp_pair):
    sub, vllm = tcp_pair()
    batches = [[stored([10, 11, 12])], [stored([13], parent=12), removed([11])],
               [stored([20, 21], n_tokens=6)], [removed([99])]]
    for events in batches:
        vllm.publish(events)
    assert sub.wait_for_seq(3)
    blocks = sub.stored
    assert parents(sub) == expected_map(batches) == {10: None, 12: 11, 13: 12, 20: None, 21: 20}
    assert blocks[13] == StoredBlock(13, 12, BS, BS, 1, "GPU")
    assert blocks[21].num_tokens == 2       # a chain whose last block is partial
    c = sub.counters
    assert (c["batches"], c["BlockStored"], c["BlockRemoved"], c["stored_total"], c["removed_total"]) == (4, 3, 2, 6, 2)
    assert c["removed_unseen"] == 1         # 99 was never stored while we listened
    assert sub.gaps == [] and sub.errors == [] and sub.connected and sub.last_batch_time is not None

    vllm.publish([CLEARED])
    vllm.publish([stored([30])])
    assert sub.wait_for_seq(5)
    assert parents(sub) == {30: None} and sub.counters["AllBlocksCleared"] == 1


def test_gap_recovered_through_replay(tcp_pair):
    sub, vllm = tcp_pair()
    batches = [[stored([1, 2])], [stored([3], 2)], [removed([1]), stored([4], 3)], [stored([5, 6], 4)],
               [removed([5])], [stored([7], 6)]]
    for i, events in enumerate(batches):
        vllm.publish(events, send=i in (0, 5))      # 1..4 never reach the subscriber live
    assert sub.wait_for_seq(5)
    assert parents(sub) == expected_map(batches) == {2: 1, 3: 2, 4: 3, 6: 5, 7: 6}
    assert vllm.replay_requests == [1]
    s = sub.snapshot()
    assert [(g.first_missing, g.last_missing, g.recovered, g.how) for g in s.gaps] == [(1, 4, True, "replay")]
    assert s.errors == [] and s.counters["replayed"] == 4 and s.counters["batches"] == 6
    # a batch that arrives twice (replayed, then live) is applied once
    vllm.pub.send_multipart((b"", (3).to_bytes(8, "big"), msgpack.packb([0.0, [stored([66])], 0])))
    vllm.publish([stored([8], 7)])
    assert sub.wait_for_seq(6)
    assert 66 not in sub.stored and 8 in sub.stored and sub.counters["duplicates"] == 1


def test_gap_beyond_the_replay_buffer_is_reported_lost(tcp_pair):
    sub, vllm = tcp_pair(buffer_steps=3)
    vllm.publish([stored([1])])                          # 0: live
    for h in range(2, 7):
        vllm.publish([stored([h])], send=False)          # 1..5: dropped; the buffer keeps only 4, 5, 6
    vllm.publish([stored([7])])                          # 6: live
    assert sub.wait_for_seq(6)
    assert set(sub.stored) == {1, 5, 6, 7}               # 2, 3, 4 are gone for good
    gaps = [(g.first_missing, g.last_missing, g.recovered) for g in sub.gaps]
    assert gaps == [(1, 3, False), (4, 5, True)]
    assert sub.gaps[0].how == "vLLM's replay buffer starts at 4"
    assert sub.errors == ["KV events 1..3 lost: vLLM's replay buffer starts at 4; the stored-block map may "
                          "miss blocks stored then, or still hold blocks removed then"]


def test_gap_without_replay_endpoint_and_replay_timeout(tcp_pair):
    sub, vllm = tcp_pair(replay=False)
    vllm.publish([stored([1])])
    vllm.publish([stored([2])], send=False)
    vllm.publish([stored([3])])
    assert sub.wait_for_seq(2)
    assert set(sub.stored) == {1, 3}
    assert sub.errors[0].startswith("KV event 1 lost: no replay endpoint was given;")

    # a replay endpoint nobody answers on: lost after the timeout, the thread carries on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    sub2, vllm2 = tcp_pair(replay=False, replay_endpoint=dead, replay_timeout_s=0.3)
    vllm2.publish([stored([1])])
    vllm2.publish([stored([2])], send=False)
    vllm2.publish([stored([3])])
    assert sub2.wait_for_seq(2)
    assert set(sub2.stored) == {1, 3} and not sub2.gaps[0].recovered
    assert "got no answer within 0.3 s" in sub2.errors[0]


def test_malformed_payload_is_recorded_and_later_batches_apply(tcp_pair):
    sub, vllm = tcp_pair()
    vllm.publish([stored([1])])
    vllm.publish_raw(b"\xc1 not msgpack")
    vllm.publish([{"type": "BlockStored", "block_hashes": [2], "token_ids": [], "block_size": -1}])
    vllm.pub.send_multipart((b"", b"\x00\x01", b""))     # a seq that is not 8 bytes
    vllm.publish([stored([3], 1)])
    assert sub.wait_for_seq(3)
    assert parents(sub) == {1: None, 3: 1}
    errs = sub.errors
    assert len(errs) == 3 and sub.counters["malformed"] == 2
    assert errs[0].startswith("KV event batch 1: payload is not msgpack")
    assert errs[1].startswith("KV event batch 2: events[0].block_size is -1, expected > 0")
    assert "8-byte seq" in errs[2]
    assert [(g.first_missing, g.recovered, g.how) for g in sub.gaps] == [(1, False, "malformed payload"),
                                                                         (2, False, "malformed payload")]
    assert vllm.replay_requests == []    # a malformed batch arrived; replaying it would not help


def test_unknown_event_type_counted_and_on_batch(tcp_pair):
    seen = []

    def on_batch(b):
        seen.append(b.seq)
        if b.seq == 1:
            raise RuntimeError("notebook callback bug")

    sub, vllm = tcp_pair(on_batch=on_batch)
    vllm.publish([stored([1]), {"type": "BlockMovedToMars", "block_hashes": [1]}])
    vllm.publish([{"type": "BlockMovedToMars"}, {"type": "Other"}, stored([2], 1)])
    vllm.publish([stored([3], 2)])
    assert sub.wait_for_seq(2)
    time.sleep(0.05)                    # on_batch runs just after the state is updated
    assert set(sub.stored) == {1, 2, 3} and seen == [0, 1, 2]
    assert sub.counters["unknown"] == 3 and sub.unknown_types == {"BlockMovedToMars": 2, "Other": 1}
    assert sub.errors == ["on_batch raised RuntimeError: notebook callback bug (batch 1); kept going"]


def test_vllm_restart_resets_the_map(tcp_pair):
    sub, vllm = tcp_pair(replay=False)
    for h in (1, 2, 3):
        vllm.publish([stored([h])])
    assert sub.wait_for_seq(2) and set(sub.stored) == {1, 2, 3}
    vllm.close()                                         # vLLM stops; a new one connects, seq from 0
    assert wait_until(lambda: not sub.connected)
    new = FakeVLLM().open_pub(sub.address)
    try:
        new.wait_subscribed()
        new.publish([stored([10])])
        new.publish([stored([11], 10)])
        assert wait_until(lambda: sub.last_seq == 1 and set(sub.stored) == {10, 11})
        assert sub.counters["restarts"] == 1 and sub.counters["duplicates"] == 0
        assert sub.errors == ["KV event seq went back from 2 to 0 on a new connection: vLLM restarted; "
                              "the stored-block map was emptied and follows the new vLLM"]
    finally:
        new.close()


# ---- joining, endpoints, closing ------------------------------------------------------
def test_ipc_endpoint_connects_and_late_join_replays(tmp_path):
    ep = f"ipc://{tmp_path}/kv.sock"
    vllm = FakeVLLM(replay=True).open_pub(ep)            # vLLM binds ipc://, so the subscriber connects
    try:
        early = [[stored([1, 2])], [stored([3], 2)], [removed([1])]]
        for events in early:
            vllm.publish(events)                         # nobody listens yet
        # vLLM's replay endpoint as configured ("tcp://*:PORT"): the subscriber connects to 127.0.0.1
        replay = vllm.replay_endpoint.replace("127.0.0.1", "*")
        with KVEventSubscriber(ep, replay_endpoint=replay, poll_ms=20) as sub:
            assert sub.mode == "connect" and sub.address == ep
            vllm.wait_subscribed()
            vllm.publish([stored([4], 3)])
            assert sub.wait_for_seq(3)
            assert parents(sub) == expected_map(early + [[stored([4], 3)]]) == {2: 1, 3: 2, 4: 3}
            assert [(g.first_missing, g.last_missing, g.recovered, g.how) for g in sub.gaps] == \
                [(0, 2, True, "replay (joined late)")]
            assert vllm.replay_requests == [0] and sub.errors == []
            assert wait_until(lambda: sub.connected)
    finally:
        vllm.close()


def test_endpoint_rule_mirrors_vllm():
    assert KVEventSubscriber("tcp://*:5557").mode == "connect"
    assert KVEventSubscriber("tcp://*:5557").address == "tcp://127.0.0.1:5557"
    assert KVEventSubscriber("ipc:///tmp/x").mode == "connect"
    assert KVEventSubscriber("tcp://127.0.0.1:5557").mode == "bind"
    assert KVEventSubscriber("tcp://localhost:5557").address == "tcp://127.0.0.1:5557"
    with pytest.raises(ValueError, match="binds only 127.0.0.1"):
        KVEventSubscriber("tcp://10.1.2.3:5557")        # vLLM would connect there; we would have to bind it
    with pytest.raises(ValueError, match="expected tcp://"):
        KVEventSubscriber("tcp://*:5557", replay_endpoint="udp://x:1")


def test_bind_failure_is_a_clear_error_and_close_is_idempotent():
    with KVEventSubscriber("tcp://127.0.0.1:0", poll_ms=10) as a:
        b = KVEventSubscriber(a.address)
        with pytest.raises(OSError, match=f"cannot bind {a.address} for vLLM's KV events"):
            b.start()
        b.close()
        assert any(t.name == "vllm-kv-events" for t in threading.enumerate())
    a.close()
    a.close()
    KVEventSubscriber("tcp://127.0.0.1:0").close()       # never started
    assert not any(t.name == "vllm-kv-events" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        a.start()
