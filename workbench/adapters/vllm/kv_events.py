"""vLLM's KV cache events, read live: which prefix-cache blocks vLLM holds right now.

vLLM (with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}')
publishes one batch per scheduler step that changed the prefix cache, through a ZMQ PUB
socket, as three frames (topic, seq as 8 bytes big-endian, msgpack payload). seq counts
from 0 per publisher, one per batch. The payload is msgspec's encoding of KVEventBatch,
an array [ts, events, data_parallel_rank]; each event is a map tagged "type":

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, ... (a chain)
    BlockRemoved      block_hashes, medium, ...
    AllBlocksCleared  (nothing)

PUB/SUB drops messages (slow joiner, high-water mark), so vLLM keeps its last
buffer_steps batches behind a ROUTER on replay_endpoint; a subscriber that sees seq jump
asks for the missing ones there. What the replay buffer no longer holds is lost, and
the subscriber says so (`gaps`, `errors`) rather than pretend its block map is exact.

    with KVEventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558") as sub:
        ...                                     # vLLM runs
        snap = sub.snapshot()                   # snap.stored: {hash: StoredBlock}
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

# The batches' wire format, decoded: kv_event_format.py (re-exported here).
from .kv_event_format import (AllBlocksCleared, BlockRemoved, BlockStored, Hash, KVEvent,  # noqa: F401
                              KVEventBatch, KVEventFormatError, UnknownEvent, decode_batch)

END_SEQ = (-1).to_bytes(8, "big", signed=True)   # vLLM's end-of-replay marker
MAX_ERRORS = 100
SUB_HWM = 100_000                 # vLLM's PUB hwm; the SUB default (1000) drops batches during a replay



# ---- endpoints -----------------------------------------------------------------------
def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (ZmqEventPublisher._is_bind_endpoint): its PUB binds these, connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _connect_address(endpoint: str) -> str:
    """Where to connect to a socket vLLM bound at `endpoint` (wildcards mean this machine)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1]
        if port == "0":
            raise ValueError(f"endpoint {endpoint!r}: vLLM picks the port for :0; "
                             "pass the endpoint vLLM logged instead")
        endpoint = endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")
    return endpoint


def _bind_address(endpoint: str) -> str:
    """What to bind where vLLM connects to `endpoint`: only a loopback TCP address."""
    host_port = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else None
    host = host_port.rsplit(":", 1)[0] if host_port and ":" in host_port else None
    if host not in ("127.0.0.1", "localhost"):
        raise ValueError(
            f"endpoint {endpoint!r}: vLLM connects to this address, so the subscriber has to bind it, "
            "and it binds only 127.0.0.1; use tcp://127.0.0.1:PORT (or a vLLM-bound "
            "tcp://*:PORT / ipc://PATH) in vLLM's kv_events_config and here")
    return "tcp://127.0.0.1:" + host_port.rsplit(":", 1)[1]


# ---- the subscriber's state ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StoredBlock:
    hash: Hash
    parent: Hash | None
    num_tokens: int
    block_size: int
    seq: int                    # the batch that stored it
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Gap:
    """Batches first_missing..last_missing (inclusive) that did not arrive live."""
    first_missing: int
    last_missing: int
    recovered: bool             # True: replayed and applied; False: lost (the block map may be off)
    how: str                    # "replay", or why they were lost


@dataclass(frozen=True)
class KVEventsSnapshot:
    """Plain copies of a subscriber's state, taken at one moment."""
    stored: dict[Hash, StoredBlock]
    counters: dict[str, int]
    unknown_types: dict[str, int]
    last_seq: int | None
    gaps: list[Gap]
    errors: list[str]
    connected: bool
    last_batch_time: float | None


def _counters() -> dict[str, int]:
    return dict.fromkeys(("batches", "BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown",
                          "stored_total", "removed_total", "removed_unseen", "duplicates", "restarts",
                          "replayed", "malformed"), 0)


def _span(a: int, b: int) -> str:
    return f"KV event {a}" if a == b else f"KV events {a}..{b}"


# ---- the subscriber ------------------------------------------------------------------
class KVEventSubscriber:
    """Follows vLLM's KV events in a daemon thread and keeps the map of blocks it holds.

    stored: {hash: StoredBlock} for blocks stored and not removed since (AllBlocksCleared
    empties it). Read it, and the rest, through the properties or snapshot(): they copy
    under the lock. The thread never raises; what goes wrong is appended to `errors`."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 on_batch: Callable[[KVEventBatch], Any] | None = None, poll_ms: int = 100,
                 replay_timeout_s: float = 2.0):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_batch, self.poll_ms, self.replay_timeout_s = on_batch, int(poll_ms), float(replay_timeout_s)
        if self.poll_ms <= 0 or self.replay_timeout_s <= 0:
            raise ValueError(f"poll_ms={poll_ms!r} and replay_timeout_s={replay_timeout_s!r} must be > 0")
        # Mirror vLLM: where its PUB connects we bind, where it binds we connect. Checked
        # here, so a wrong endpoint fails in the notebook cell that made the subscriber.
        self.mode = "connect" if vllm_binds(endpoint) else "bind"
        self.address = _connect_address(endpoint) if self.mode == "connect" else _bind_address(endpoint)
        self._replay_address = _connect_address(replay_endpoint) if replay_endpoint else None

        self._lock = threading.Condition()
        self._stored: dict[Hash, StoredBlock] = {}
        self._counters = _counters()
        self._unknown_types: Counter[str] = Counter()
        self._last_seq: int | None = None
        self._gaps: list[Gap] = []
        self._errors: deque[str] = deque(maxlen=MAX_ERRORS)
        self._peers = 0
        self._reconnected = False   # a publisher (re)connected since the last batch: seq may restart at 0
        self._last_batch_time: float | None = None

        self._ctx: zmq.Context | None = None
        self._sub = self._monitor = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False

    # -- lifecycle
    def start(self) -> "KVEventSubscriber":
        if self._closed:
            raise RuntimeError("KVEventSubscriber is closed; make a new one")
        if self._thread is not None:
            return self
        # A private context: close() terminates it, so nothing of ZMQ outlives the subscriber.
        self._ctx = zmq.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = SUB_HWM
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            if self.address.startswith("tcp://[::1]"):
                sub.setsockopt(zmq.IPV6, 1)
            if self.mode == "bind":
                sub.bind(self.address)
                self.address = sub.getsockopt_string(zmq.LAST_ENDPOINT)   # the real port for :0
            else:
                sub.connect(self.address)
        except zmq.ZMQError as e:
            self._sub = sub
            self._close_sockets()
            hint = (" (another subscriber, maybe one made by an earlier cell, holds it: close() that one)"
                    if e.errno == zmq.EADDRINUSE else "")
            raise OSError(f"cannot {self.mode} {self.address} for vLLM's KV events: {e}{hint}") from None
        self._sub = sub
        # Sockets are made here and handed to the thread (Thread.start is the memory barrier
        # pyzmq asks for); from now on only the thread touches them, until close() joins it.
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and close the sockets; safe to call twice, or before start()."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.replay_timeout_s + self.poll_ms / 1000 + 2.0)
            if self._thread.is_alive():     # stuck: leave its sockets alone rather than close them under it
                self._error("the KV event thread did not stop within its timeout; sockets left open")
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._sub is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sub.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sub = self._monitor = self._ctx = None

    def __enter__(self) -> "KVEventSubscriber":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading the state (copies, under the lock)
    def snapshot(self) -> KVEventsSnapshot:
        with self._lock:
            return KVEventsSnapshot(dict(self._stored), dict(self._counters), dict(self._unknown_types),
                                    self._last_seq, list(self._gaps), list(self._errors),
                                    self._peers > 0, self._last_batch_time)

    @property
    def stored(self) -> dict[Hash, StoredBlock]:
        with self._lock:
            return dict(self._stored)

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    @property
    def unknown_types(self) -> dict[str, int]:
        with self._lock:
            return dict(self._unknown_types)

    @property
    def last_seq(self) -> int | None:
        with self._lock:
            return self._last_seq

    @property
    def gaps(self) -> list[Gap]:
        with self._lock:
            return list(self._gaps)

    @property
    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)

    @property
    def connected(self) -> bool:
        """A publisher is connected (ZMQ socket monitor), whether or not it published yet."""
        with self._lock:
            return self._peers > 0

    @property
    def last_batch_time(self) -> float | None:
        with self._lock:
            return self._last_batch_time

    def wait_for_seq(self, seq: int, timeout_s: float = 5.0) -> bool:
        """Block until batch `seq` (or a later one) was handled; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._last_seq is not None and self._last_seq >= seq, timeout_s)

    def __repr__(self) -> str:
        s = self.snapshot()
        return (f"<KVEventSubscriber {self.mode} {self.address} last_seq={s.last_seq} "
                f"stored={len(s.stored)} lost_gaps={sum(not g.recovered for g in s.gaps)} errors={len(s.errors)}>")

    # -- the thread
    def _error(self, msg: str) -> None:
        with self._lock:
            self._errors.append(msg)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self.poll_ms))
                if self._monitor in ready:
                    self._drain_monitor()
                # A bounded drain, so close() is seen even under a flood of batches.
                for _ in range(1000 if self._sub in ready else 0):
                    try:
                        frames = self._sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            except Exception as e:      # never into the notebook: record, back off, go on
                self._error(f"KV event loop: {type(e).__name__}: {e}")
                self._stop.wait(self.poll_ms / 1000)

    def _drain_monitor(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            with self._lock:
                if ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                    self._peers += 1
                    self._reconnected = self._last_seq is not None
                elif ev == zmq.EVENT_DISCONNECTED:
                    self._peers = max(0, self._peers - 1)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._error(f"a KV event message of {len(frames)} frames "
                        f"{[len(f) for f in frames]} bytes, expected (topic, 8-byte seq, payload); skipped")
            return
        seq = int.from_bytes(frames[1], "big")
        with self._lock:
            last, reconnected, self._reconnected = self._last_seq, self._reconnected, False
            if last is not None and seq <= last:
                if not reconnected:
                    self._counters["duplicates"] += 1   # seen already: ignored
                    return
                # An old seq from a connection made since the last batch: a new vLLM process
                # (seq counts from 0 per publisher) whose cache starts empty. Ignoring it as
                # "old" would ignore that vLLM for good.
                self._counters["restarts"] += 1
                self._stored.clear()
                self._errors.append(f"KV event seq went back from {last} to {seq} on a new connection: "
                                    "vLLM restarted; the stored-block map was emptied and follows the new vLLM")
                self._last_seq = last = None
        if last is None and seq > 0:
            self._catch_up(0, seq, late_join=True)
        elif last is not None and seq > last + 1:
            self._catch_up(last + 1, seq)
        self._apply_payload(seq, frames[2])

    def _catch_up(self, want: int, upto: int, late_join: bool = False) -> None:
        """Batches want..upto-1 did not arrive: replay them if vLLM still has them, else say so."""
        if self._replay_address is None:
            why = ("this subscriber joined after vLLM published them and has no replay endpoint"
                   if late_join else "no replay endpoint was given")
            self._lost(want, upto - 1, why)
            return
        got, failure = self._request_replay(want)
        oldest = min((s for s, _ in got), default=None)     # what vLLM's buffer still holds
        got = sorted(((s, p) for s, p in got if want <= s < upto), key=lambda sp: sp[0])
        how = "replay (joined late)" if late_join else "replay"
        nxt, run = want, None           # run: the first seq of the replayed run being applied
        for s, payload in got:
            if s < nxt:                 # a batch replayed twice
                continue
            if s > nxt:
                if run is not None:
                    self._recovered(run, nxt - 1, how)
                    run = None
                why = (f"vLLM's replay buffer starts at {s}" if nxt == want
                       else f"vLLM's replay skipped them (it sent {nxt - 1} then {s})")
                self._lost(nxt, s - 1, why)
            run = s if run is None else run
            self._apply_payload(s, payload, replayed=True)
            nxt = s + 1
        if run is not None:
            self._recovered(run, nxt - 1, how)
        if nxt < upto:
            if failure:
                why = failure
            elif got:
                why = f"vLLM's replay ended at {nxt - 1}"
            elif oldest is not None:
                why = f"vLLM's replay buffer starts at {oldest}"
            else:
                why = f"vLLM's replay buffer holds nothing from {want} on"
            self._lost(nxt, upto - 1, why)

    def _recovered(self, a: int, b: int, how: str) -> None:
        with self._lock:
            self._gaps.append(Gap(a, b, True, how))

    def _lost(self, a: int, b: int, why: str) -> None:
        with self._lock:
            self._gaps.append(Gap(a, b, False, why))
            self._errors.append(f"{_span(a, b)} lost: {why}; the stored-block map may miss blocks "
                                "stored then, or still hold blocks removed then")

    def _request_replay(self, start: int) -> tuple[list[tuple[int, bytes]], str | None]:
        """vLLM's replay protocol: a DEALER sends [b"", start]; the ROUTER answers [b"", topic,
        seq, payload] per buffered batch >= start, then [b"", b"", END_SEQ, b""].
        Returns (batches, why it failed or None). A fresh socket per request, so a late
        answer to a request that timed out cannot mix into the next one."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        out: list[tuple[int, bytes]] = []
        try:
            if self._replay_address.startswith("tcp://[::1]"):
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(self._replay_address)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            # The timeout is for silence, not the whole answer: 10000 buffered batches take a while.
            while not self._stop.is_set():
                if not dealer.poll(int(self.replay_timeout_s * 1000)):
                    return out, (f"the replay request to {self.replay_endpoint} got no answer within "
                                 f"{self.replay_timeout_s:g} s")
                frames = dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:
                    return out, None
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._error(f"a replay message of {len(frames)} frames, expected "
                                "(empty, topic, 8-byte seq, payload); skipped")
                    continue
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
            return out, "the subscriber was closed during the replay"
        except zmq.ZMQError as e:
            return out, f"the replay request to {self.replay_endpoint} failed ({e})"
        finally:
            dealer.close(linger=0)

    def _apply_payload(self, seq: int, payload: bytes, replayed: bool = False) -> None:
        try:
            batch = decode_batch(seq, payload)
        except KVEventFormatError as e:
            with self._lock:
                self._counters["malformed"] += 1
                self._last_seq = seq    # it did arrive; asking for it again would not make it readable
                self._gaps.append(Gap(seq, seq, False, "malformed payload"))
                self._errors.append(f"{e}; batch skipped, the stored-block map may miss its changes")
                self._lock.notify_all()
            return
        with self._lock:
            self._apply(batch)
            if replayed:
                self._counters["replayed"] += 1
            self._lock.notify_all()
        if self.on_batch is not None:
            try:
                self.on_batch(batch)
            except Exception as e:      # the caller's code, in our thread: record, keep going
                self._error(f"on_batch raised {type(e).__name__}: {e} (batch {seq}); kept going")

    def _apply(self, batch: KVEventBatch) -> None:
        """Apply one decoded batch to the map; the caller holds the lock."""
        c, stored = self._counters, self._stored
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                c["BlockStored"] += 1
                parent, bs, n_tok = ev.parent_block_hash, ev.block_size, len(ev.token_ids)
                for i, h in enumerate(ev.block_hashes):
                    c["stored_total"] += 1
                    # vLLM re-announces reused blocks; the first store is when it entered the cache
                    if h not in stored:
                        stored[h] = StoredBlock(h, parent, max(0, min(bs, n_tok - i * bs)), bs, batch.seq, ev.medium)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                c["BlockRemoved"] += 1
                for h in ev.block_hashes:
                    c["removed_total"] += 1
                    if stored.pop(h, None) is None:
                        c["removed_unseen"] += 1    # stored while we were not listening (or lost)
            elif isinstance(ev, AllBlocksCleared):
                c["AllBlocksCleared"] += 1
                stored.clear()
            else:
                c["unknown"] += 1
                self._unknown_types[ev.type] += 1
        c["batches"] += 1
        self._last_seq = batch.seq
        self._last_batch_time = time.time()
