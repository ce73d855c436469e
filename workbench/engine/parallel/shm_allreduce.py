"""The all-reduce of ranks on one host through shared memory (gloo carries everything else).

Why: a step all-reduces twice per layer (60 times for SmolLM2's 30 layers), a few tens of
KB each at decode. Through gloo's TCP loopback each one is a hand-off to gloo's I/O thread
on both sides; on a 2-core host whose cores the ranks' compute threads keep busy, those
threads wait for a time slice, and a decode step spent about half its time in the 60
all-reduces (benchmarks/tp_speed.py). Here each rank's main thread writes its partial sum
into its slot of a shared buffer, publishes a sequence number, and sums every slot once all
ranks published: no other thread, no socket. Every rank adds the slots in rank order, so
every rank holds the same bits (as with gloo).

Layout of the file (in /dev/shm, unlinked as soon as every rank mapped it, so nothing is
left behind even if the driver is killed): one 64-byte line per rank holding its sequence
number, then two buffers (alternating by sequence parity) of `world` slots of `slot_bytes`.
Reusing a buffer is safe: a rank writes buffer s % 2 at sequence s only after every rank
published s - 1, that is after every rank finished reading buffer s % 2 of sequence s - 2.

Ordering: x86-64 keeps stores in order and loads in order (TSO), so a peer that sees the
sequence number sees the data written before it; other architectures (the aarch64 hosts of
Ascend cards) need fences this Python code cannot issue, and use gloo (available()).

Waiting spins on the peers' sequence numbers, yielding the CPU between looks; every 20 ms
it asks `peers_alive()`, so a dead rank is named within that, and it gives up after the
group's timeout.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid

import numpy as np
import torch

LINE = 64


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def wanted(mode: str = "auto") -> bool:
    """EngineConfig.tp_allreduce (PAGEDKV_TP_ALLREDUCE overrides it): auto / shm where it applies, gloo never."""
    return mode != "gloo" and available()


def create(world: int, slot_bytes: int) -> str:
    """A zeroed file for `world` ranks; returns its path (map it with ShmAllReduce, then unlink it)."""
    path = f"/dev/shm/pagedkv-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    size = LINE * world + 2 * world * slot_bytes
    with open(path, "wb") as f:
        f.truncate(size)
    return path


class PeerGone(RuntimeError):
    pass


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float, peers_alive=None):
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.peers_alive = peers_alive
        size = LINE * world + 2 * world * slot_bytes
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), size)
        self.seqs = np.frombuffer(self.map, dtype=np.int64, count=world * LINE // 8).reshape(world, LINE // 8)[:, 0]
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, offset=LINE * world,
                                     count=2 * world * slot_bytes).view(2, world, slot_bytes)
        self.seq = 0
        self.others = [r for r in range(world) if r != rank]

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes and t.is_contiguous() and t.device.type == "cpu"

    def _slot(self, buf: int, r: int, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        return self.data[buf, r, :n].view(t.dtype).view(t.shape)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        s, buf = self.seq, self.seq % 2
        self._slot(buf, self.rank, t).copy_(t)
        self.seqs[self.rank] = s                     # publish: the data above is visible first (TSO)
        self._wait(s)
        t.copy_(self._slot(buf, 0, t))
        for r in range(1, self.world):
            t.add_(self._slot(buf, r, t))
        return t

    def _wait(self, s: int) -> None:
        seqs, others = self.seqs, self.others
        spins = 0
        t0 = None
        while True:
            if all(seqs[r] >= s for r in others):
                return
            spins += 1
            if spins < 64:
                continue
            os.sched_yield()
            if spins % 256 == 0:
                now = time.monotonic()
                if t0 is None:
                    t0, last = now, now
                if now - t0 > self.timeout_s:
                    late = [r for r in others if seqs[r] < s]
                    raise RuntimeError(f"shared-memory all-reduce timed out after {self.timeout_s:.0f} s "
                                       f"waiting for ranks {late}")
                if self.peers_alive is not None and now - last > 0.02:
                    last = now
                    dead = self.peers_alive()
                    if dead:
                        raise PeerGone(f"rank(s) {dead} left during an all-reduce")

    def close(self) -> None:
        self.seqs = self.data = None
        try:
            self.map.close()
        except (BufferError, ValueError):            # a view still alive: the mapping goes with the process
            pass
