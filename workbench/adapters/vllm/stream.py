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
import threading
import time

import numpy as np

KINDS = (b"hello", b"step", b"finding", b"error", b"cost", b"status")
ARRAYS = (("ref", np.int32), ("owner", np.int32), ("cached", np.uint8))


SMALL = 16 * 1024          # bytes: a message up to this size goes on the small queue


class Publisher:
    """The plugin's end: connect PUBs to the workbench's address; send() never blocks.

    What waits for a slow (or absent, or stalled) listener is bounded in bytes, not only in
    messages: two PUB sockets to the one address, each with its own queue (ZMQ's high-water mark):
    messages up to SMALL bytes (findings, step headers, statuses; `small_hwm` of them: <= 64 MB) and
    larger ones (a pool snapshot, the idle sweep's hashes; `bulk_hwm` of them: a few snapshots). A
    message that finds its queue full is dropped and counted (`dropped`, `dropped_bytes`): the newest,
    what is queued is kept (ZMQ cannot drop from the head of a queue); vLLM never waits."""

    def __init__(self, address: str, small_hwm: int = 4096, bulk_hwm: int = 4):
        import zmq
        self._zmq = zmq
        self.address = address
        self.ctx = zmq.Context.instance()
        self.socks = {}
        for name, hwm in (("small", small_hwm), ("bulk", bulk_hwm)):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, hwm)
            # a full queue answers EAGAIN instead of PUB's silent drop: the drop is then ours to count
            s.setsockopt(zmq.XPUB_NODROP, 1)
            s.connect(address)
            self.socks[name] = s
        self.sock = self.socks["small"]
        self.lock = threading.Lock()           # engine core and its threads may both send
        self.dropped = 0
        self.dropped_bytes = 0

    def send(self, kind: bytes, header: dict, arrays=()) -> None:
        frames = [kind, json.dumps(header, default=str).encode()]
        frames += [np.ascontiguousarray(a).tobytes() for a in arrays]
        size = sum(len(f) for f in frames)
        sock = self.socks["small" if size <= SMALL else "bulk"]
        with self.lock:
            try:
                sock.send_multipart(frames, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.dropped += 1
                self.dropped_bytes += size

    def close(self) -> None:
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
