"""The sanitizer stream: what the plugin inside vLLM sends the workbench, one schema for both ends.

ZMQ PUB/SUB over TCP on 127.0.0.1. The workbench BINDS a SUB socket; each vLLM process
with the plugin CONNECTS a PUB to it (engine core and workers are separate processes, so
many publishers, one listener). PUB never blocks: with no workbench listening, messages
are dropped and vLLM runs on at full speed.

A message is multipart: [kind, JSON header, *raw arrays]. Kinds:

  hello    {pid, process, vllm_version}                                   once per process
  step     {step, t, step_s, check_s, num_blocks, block_size, num_free, running, waiting, full,
            names: {owner index: request id}, hashed}                     after each checked step
           + on a full sweep (full: true; at idle, and every PAGEDKV_VLLM_FULL_EVERY checks if set)
             three arrays, one entry per block: ref (int32), owner (int32, index into the
             names sent so far, -1 none), cached (uint8: free and still holding a prefix hash);
             the incremental checks in between send the same three arrays for the rotating
             slice they read (slice_lo: its first block; the arrays' length: its size)
  finding  {probe, kind, severity, message, hint, step, request_id, page, evidence}
  error    {message}                                                      a check that failed to run
  cost     {process, checks, check_s, executions}   the worker's metadata checks so far (cumulative),
                                          at least every second while it works: its heartbeat
  status   {check, active, via, path, reason}   what a check runs on (status.py), at start-up and
                                          every few seconds
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque

import numpy as np

KINDS = (b"hello", b"step", b"finding", b"error", b"cost", b"status")
ARRAYS = (("ref", np.int32), ("owner", np.int32), ("cached", np.uint8))


SMALL = 16 * 1024          # bytes: a message up to this size goes on the small queue


class Publisher:
    """The plugin's end: connect PUBs to the workbench's address; send() never blocks.

    What waits for a slow (or absent, or stalled) listener is bounded in bytes: two queues of our
    own, small messages (up to SMALL bytes: findings, step headers, statuses; `small_bytes` in all)
    and big ones (a pool snapshot, the idle sweep's hashes; `bulk_bytes`), so a finding never waits
    behind snapshots. A queue over its budget drops its OLDEST messages, counted (`dropped`,
    `dropped_bytes`): when the listener reads again it gets the newest state, not a stale backlog.
    A sender thread moves messages from the queues into two PUB sockets, whose own ZMQ queues are
    kept short (`small_hwm` / `bulk_hwm` messages: ZMQ itself can only refuse the newest), and
    waits, without the GIL, while they are full. send() only appends under a lock: vLLM never waits
    on the listener."""

    def __init__(self, address: str, small_bytes: int = 32 << 20, bulk_bytes: int = 64 << 20,
                 small_hwm: int = 256, bulk_hwm: int = 2):
        import zmq
        self._zmq = zmq
        self.address = address
        self.pid = os.getpid()
        self.ctx = zmq.Context.instance()
        self.socks = {}
        for name, hwm in (("small", small_hwm), ("bulk", bulk_hwm)):
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, hwm)
            # a full ZMQ queue answers EAGAIN instead of PUB's silent drop: the message stays ours
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            sock.connect(address)
            self.socks[name] = sock
        self.sock = self.socks["small"]
        self.budget = {"small": int(small_bytes), "bulk": int(bulk_bytes)}
        self.queues: dict[str, deque] = {"small": deque(), "bulk": deque()}
        self.queued_bytes = {"small": 0, "bulk": 0}
        self.cv = threading.Condition()        # engine core and its threads may all send
        self.dropped = 0
        self.dropped_bytes = 0
        self.sent = 0
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="kvwb-plugin-send", daemon=True)
        self._sender.start()

    def send(self, kind: bytes, header: dict, arrays=()) -> None:
        frames = [kind, json.dumps(header, default=str).encode()]
        frames += [np.ascontiguousarray(a).tobytes() for a in arrays]
        size = sum(len(f) for f in frames)
        name = "small" if size <= SMALL else "bulk"
        with self.cv:
            if self._closed:
                self._drop(size)
                return
            q = self.queues[name]
            q.append((frames, size))
            self.queued_bytes[name] += size
            while self.queued_bytes[name] > self.budget[name] and len(q) > 1:   # the newest always stays
                _, old = q.popleft()
                self.queued_bytes[name] -= old
                self._drop(old)
            self.cv.notify()

    def _drop(self, size: int) -> None:
        self.dropped += 1
        self.dropped_bytes += size

    def _take(self):
        """The oldest queued message (small ones first), or None once closed and empty."""
        with self.cv:
            while not (self.queues["small"] or self.queues["bulk"]):
                if self._closed:
                    return None
                self.cv.wait(0.5)
            name = "small" if self.queues["small"] else "bulk"
            frames, size = self.queues[name].popleft()
            self.queued_bytes[name] -= size
            return name, frames, size

    def _send_loop(self) -> None:
        zmq = self._zmq
        while True:
            got = self._take()
            if got is None:
                return
            name, frames, size = got
            sock = self.socks[name]
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                self.sent += 1
                continue
            except zmq.Again:
                pass
            except zmq.ZMQError:                       # closed under us: nothing more can go
                return
            # its ZMQ queue is full (the listener is slow): the message goes back as the oldest, where
            # newer ones arriving over the budget drop it; then wait for room, without the GIL
            with self.cv:
                q = self.queues[name]
                if self._closed or (q and self.queued_bytes[name] + size > self.budget[name]):
                    self._drop(size)
                else:
                    q.appendleft((frames, size))
                    self.queued_bytes[name] += size
            try:
                sock.poll(100, zmq.POLLOUT)
            except zmq.ZMQError:
                return

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait up to timeout_s for the queues to empty (a process about to exit); whether they did."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self.cv:
                if not (self.queues["small"] or self.queues["bulk"]):
                    return True
            time.sleep(0.01)
        return False

    def close(self, flush_s: float = 0.5) -> None:
        self.flush(flush_s)
        with self.cv:
            self._closed = True
            for name, q in self.queues.items():
                for _, size in q:
                    self._drop(size)
                q.clear()
                self.queued_bytes[name] = 0
            self.cv.notify_all()
        self._sender.join(timeout=2.0)
        for s in self.socks.values():
            s.close(0)


def decode(frames: list[bytes]) -> tuple[str, dict, dict]:
    """(kind, header, arrays) from one message; ValueError naming what is wrong."""
    if len(frames) < 2:
        raise ValueError(f"sanitizer message of {len(frames)} frames (want kind, header, ...)")
    kind = frames[0]
    if kind not in KINDS:
        raise ValueError(f"sanitizer message of unknown kind {kind[:20]!r}")
    try:
        header = json.loads(frames[1])
    except ValueError as e:
        raise ValueError(f"sanitizer {kind.decode()} header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"sanitizer {kind.decode()} header is a {type(header).__name__}, not an object")
    arrays = {}
    if kind == b"step":
        if len(frames) == 2:
            return kind.decode(), header, arrays          # an incremental check: no snapshot
        if len(frames) != 2 + len(ARRAYS):
            raise ValueError(f"sanitizer step {header.get('step')}: {len(frames) - 2} arrays, want 0 or {len(ARRAYS)}")
        n = header.get("num_blocks")
        lo = header.get("slice_lo")
        for (name, dtype), raw in zip(ARRAYS, frames[2:]):
            a = np.frombuffer(raw, dtype=dtype)
            if lo is None and len(a) != n:
                raise ValueError(f"sanitizer step {header.get('step')}: array {name!r} has {len(a)} entries, "
                                 f"num_blocks says {n}")
            if lo is not None and not (isinstance(lo, int) and isinstance(n, int) and 0 <= lo and lo + len(a) <= n):
                raise ValueError(f"sanitizer step {header.get('step')}: slice of {len(a)} blocks at {lo!r} does not "
                                 f"fit num_blocks {n}")
            arrays[name] = a
    return kind.decode(), header, arrays


def now() -> float:
    return time.time()
