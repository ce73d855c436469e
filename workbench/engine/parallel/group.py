"""The process group the ranks talk over: torch.distributed's gloo backend on 127.0.0.1.

A group of our own (a ProcessGroupGloo over a TCPStore), not torch.distributed's global
default group: a notebook may build, close and rebuild engines, or hold two, and a script
under torchrun may have its own default group. Every collective is timed (comm_ns, the
communication share of a step) and waits at most `timeout_s` (gloo's own timeout: a rank
that hangs makes the others raise instead of waiting forever; a rank that dies closes its
sockets, and its peers' next collective fails at once).

Rendezvous: spawned workers (Engine.from_default(EngineConfig(tensor_parallel_size=N)))
meet at a TCPStore the driver opens on 127.0.0.1 at a free port (the store binds port 0 and
reports the one it got); under torchrun, at torchrun's own store (env://, MASTER_ADDR /
MASTER_PORT), under a key prefix of ours.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from ..config import EngineConfig

HOST = "127.0.0.1"
PREFIX = "pagedkv/"
# A collective inside a step waits at most this long for the slowest rank (a long prefill on
# a busy host takes seconds, not minutes); a dead rank is seen at once, not after it.
# EngineConfig.tp_timeout_s (PAGEDKV_TP_TIMEOUT_S) sets it; this is its default.
DEFAULT_TIMEOUT_S = EngineConfig.tp_timeout_s
# Between steps a worker waits for the driver's next plan for as long as the driver idles.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_store(world: int, timeout_s: float):
    """A TCPStore for a spawned group, hosted here on 127.0.0.1 at a free port (store.port)."""
    return dist.TCPStore(HOST, 0, world, is_master=True, timeout=_td(timeout_s), wait_for_workers=False)


def join_store(port: int, world: int, timeout_s: float):
    return dist.TCPStore(HOST, port, world, is_master=False, timeout=_td(timeout_s))


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its env:// rendezvous variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def torchrun_store(timeout_s: float):
    """(store, rank, world) from torchrun's environment, the store under our prefix."""
    store, rank, world = next(dist.rendezvous("env://", timeout=_td(timeout_s)))
    return dist.PrefixStore(PREFIX, store), rank, world


class Group:
    """A gloo process group of `world` ranks, every collective timed."""

    def __init__(self, store, rank: int, world: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.timeout = _td(timeout_s)
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
        except (AttributeError, TypeError):        # an older layout of the options: bind by interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            self.pg = dist.ProcessGroupGloo(store, rank, world, self.timeout)
        self.comm_ns = 0            # time inside collectives (waiting for the slowest rank included)
        self.comm_bytes = 0         # bytes this rank handed to them
        self.closed = False
        self.shm = None             # a ShmAllReduce when the ranks share a host (shm_allreduce.py)

    def _wait(self, work, nbytes: int) -> None:
        t0 = time.perf_counter_ns()
        try:
            work.wait()
        finally:
            self.comm_ns += time.perf_counter_ns() - t0
            self.comm_bytes += nbytes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (through shared memory when the ranks share a host)."""
        shm = self.shm
        if shm is not None and shm.fits(t):
            t0 = time.perf_counter_ns()
            try:
                return shm.all_reduce(t)
            finally:
                self.comm_ns += time.perf_counter_ns() - t0
                self.comm_bytes += t.numel() * t.element_size()
        self._wait(self.pg.allreduce([t]), t.numel() * t.element_size())
        return t

    @property
    def all_reduce_path(self) -> str:
        return "shared memory" if self.shm is not None else "gloo"

    def broadcast(self, t: torch.Tensor, root: int = 0, idle: bool = False) -> torch.Tensor:
        """t from root to every rank, in place. idle=True: a worker waiting for the next plan
        (as long as the driver idles; untimed, it is not communication of a step)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        if idle:
            opts.timeout = IDLE_TIMEOUT
        work = self.pg.broadcast([t], opts)
        if idle:
            work.wait()
        else:
            self._wait(work, t.numel() * t.element_size())
        return t

    def gather(self, t: torch.Tensor, root: int = 0) -> list[torch.Tensor] | None:
        """Every rank's t (same shape everywhere) on root; None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = root
        if self.rank == root:
            out = [torch.empty_like(t) for _ in range(self.world)]
            self._wait(self.pg.gather([out], [t], opts), t.numel() * t.element_size())
            return out
        self._wait(self.pg.gather([], [t], opts), t.numel() * t.element_size())
        return None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(self.pg.allgather([out], [t]), t.numel() * t.element_size())
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for name in ("shutdown", "abort"):
            fn = getattr(self.pg, name, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:           # noqa: BLE001 - a broken group may refuse either
                    continue
        # Destroyed now, not at interpreter teardown: gloo's threads met there abort the process
        # ("terminate called without an active exception"), one exit in three.
        self.pg = None
