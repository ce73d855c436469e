"""The plugin's send queue is bounded in bytes: a listener that stalls (connected, never reading) costs
vLLM a few snapshots of memory at most, the OLDEST are dropped and counted, and the listener gets the
stream again once it reads, newest state included. A real ZMQ PUB/SUB over TCP on 127.0.0.1."""
from __future__ import annotations

import time

import numpy as np
import zmq

from workbench.adapters.vllm.stream import SMALL, Publisher, decode

from vllm_fakes import free_addr, wait_until


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def test_a_stalled_listener_costs_bounded_bytes_and_drops_are_counted():
    addr = free_addr()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 2)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(addr)
    pub = Publisher(addr, small_hwm=64, bulk_hwm=2, bulk_bytes=40 << 20)      # two 18 MB snapshots
    try:
        hellos = []
        assert wait_until(lambda: (hellos.append(1), pub.send(b"hello", {"pid": 1}), sub.poll(50))[2], timeout=5)
        while sub.poll(10):
            sub.recv_multipart()
        before = rss()
        snap = np.zeros(2_000_000, np.int32)                          # an 8 MB pool snapshot
        for i in range(60):                                           # the listener does not read
            pub.send(b"step", {"step": i, "num_blocks": len(snap)}, (snap, snap, snap.astype(np.uint8)))
        time.sleep(0.5)
        grown = rss() - before
        assert pub.dropped >= 40 and pub.dropped_bytes >= 40 * 2 * 8_000_000, (pub.dropped, pub.dropped_bytes)
        assert grown < 400 * 2**20, grown                             # 60 snapshots would be ~1.1 GB
        # small messages keep their own queue: a finding is not lost behind the snapshots
        pub.send(b"finding", {"probe": "vllm_pool", "kind": "leak", "severity": "error", "message": "m"})
        got = []
        t0 = time.time()
        while time.time() - t0 < 10 and not (any(k == "finding" for k, _, _ in got) and
                                             any(k == "step" and h["step"] == 59 for k, h, _ in got)):
            if sub.poll(100):
                got.append(decode(sub.recv_multipart()))
        assert any(k == "finding" for k, _, _ in got)
        assert all(len(h) < SMALL for k, h, _ in got if k == "finding")
        # what was dropped is the oldest backlog: the two newest snapshots (the bulk queue's two places)
        # always arrive, and only the few that left before the pipes filled besides them. How many left
        # early depends on how fast this host's sender thread ran, so that is not asserted
        steps = sorted(h["step"] for k, h, _ in got if k == "step")
        assert steps[-2:] == [58, 59] and len(steps) <= 60 - 40, steps
        assert wait_until(lambda: pub.sent + pub.dropped == len(hellos) + 60 + 1, timeout=5)   # nothing unaccounted
    finally:
        pub.close()
        sub.close(0)
        ctx.destroy(linger=0)
