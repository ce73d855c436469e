"""The driver: rank 0 of a tensor-parallel engine. It schedules (the engine's own scheduler,
pool and batch builder run here only), and around every forward runs the step protocol:

    plan (header + payload: plan_broadcast.py) -> every rank -> forward over rank 0's heads
    (the all-reduces and the logits gather meet the workers' own) -> the per-rank reports
    (RankStepFinished, when someone listens) -> the per-step taps (a probe's vectors, all-gathered)

It starts the workers itself (torch.multiprocessing, start method spawn, a store on
127.0.0.1 at a free port) or, under torchrun, joins the ranks torchrun started; and it ends
them: close() (also from Engine.close(), the engine's __del__ and atexit) sends the
shutdown and reaps every process, terminating what does not leave in time. A rank that dies
makes the next collective fail at once (its sockets close); one that hangs makes it time out
(gloo's timeout, EngineConfig.tp_timeout_s). Either way the driver raises RankFailed naming the
rank (its exit code or signal, or the error it left in the store), shuts the others down and
refuses further steps: a group that lost a rank mid-step cannot be resumed. A KeyboardInterrupt
(an interrupted notebook kernel) inside a step does the same and is re-raised.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ...events import RankStepFinished, now_ns
from ..config import ConfigError
from . import plan_broadcast as pb
from . import shm_allreduce
from .group import Group, open_store, torchrun_store, under_torchrun
from .rank_health import RankFailed, RankHealth
from .shard import TensorParallelModel, plan_shards, shard_config
from .worker import STATS_FIELDS, RankView, _fixed, _tap_values, load_function, stats_vector, step_bytes

JOIN_TIMEOUT_S = 10.0

_LIVE: "weakref.WeakSet[Driver]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for d in list(_LIVE):
        try:
            d.close()
        except Exception:                 # noqa: BLE001 - at exit, close what can be closed
            pass


class Driver(RankHealth):
    def __init__(self, loaded, config, device, dtype: torch.dtype, max_model_len: int, num_pages: int):
        world = config.tensor_parallel_size
        mc = loaded.config
        if device.type != "cpu":
            raise ConfigError(f"tensor_parallel_size={world} runs over gloo on the CPU here; device {device.type!r} "
                              f"needs its collective backend (hccl on Ascend, nccl on CUDA), not wired yet: use "
                              f"device='cpu' or tensor_parallel_size=1")
        self.plan = plan_shards(mc, world)            # ConfigError naming the heads when there is no split
        self.world, self.config = world, config
        self.shard_config = shard_config(mc, self.plan, 0)
        # EngineConfig.tp_timeout_s / tp_startup_s (PAGEDKV_TP_TIMEOUT_S / _STARTUP_S override them)
        self.timeout_s, self.startup_s = config.tp_timeout_s, config.tp_startup_s   # startup: load + shard, busy host
        self.engine_ref: Callable[[], Any] = lambda: None
        self.procs: dict[int, Any] = {}               # rank -> multiprocessing.Process (spawned ranks)
        self.pids: dict[int, int] = {}
        self.closed = False
        self.broken: str | None = None
        self.tracker = pb.UpdateTracker()
        self.taps: dict[str, tuple] = {}              # name -> (fn, size, callback)
        self.last_batch = None
        self.steps = 0
        # The collectives of a step, a control message or a call must not interleave: a probe attached
        # from the notebook's thread while another thread steps the engine waits for the step.
        self.lock = threading.RLock()
        self._old_threads = torch.get_num_threads()
        # One intra-op thread per core a rank gets (2 cores, 2 ranks: one each; more would thrash).
        self.num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(self.num_threads)
        self.torchrun = under_torchrun()
        if self.torchrun:
            store, rank, w = torchrun_store(self.startup_s)
            if rank != 0 or w != world:
                raise ConfigError(f"under torchrun this process is rank {rank} of {w}: the engine is built on rank 0 "
                                  f"with tensor_parallel_size equal to the world size ({world} asked)")
        else:
            store = open_store(world, self.startup_s)
        self.store = store
        cfg = dict(config.to_dict(), capture_trace=None, device="cpu")
        # The all-reduces through shared memory when every rank is on this host (shm_allreduce.py).
        local = not self.torchrun or int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
        self.shm_path = None
        slot = config.max_num_batched_tokens * mc.hidden_size * torch.empty(0, dtype=dtype).element_size()
        if local and shm_allreduce.wanted(config.tp_allreduce):
            self.shm_path = shm_allreduce.create(world, slot)
        store.set("hello/0", str(os.getpid()))
        store.set("config", json.dumps({
            "engine_config": cfg, "model_path": loaded.source, "model_config": dataclasses.asdict(mc),
            "num_pages": num_pages, "max_model_len": max_model_len, "timeout_s": self.timeout_s,
            "num_threads": self.num_threads, "shm_path": self.shm_path, "shm_slot_bytes": slot}))
        _LIVE.add(self)
        try:
            if not self.torchrun:
                ctx = torch.multiprocessing.get_context("spawn")
                from .worker import spawn_main
                for r in range(1, world):
                    p = ctx.Process(target=spawn_main, args=(r, world, store.port, os.getpid(), self.timeout_s),
                                    daemon=True, name=f"pagedkv-tp-rank{r}")
                    p.start()
                    self.procs[r] = p
                    self.pids[r] = p.pid
            deadline = time.monotonic() + self.startup_s
            self._wait_for("hello", deadline)
            for r in range(1, world):
                self.pids[r] = int(store.get(f"hello/{r}").decode())
            self.group = Group(store, 0, world, self.timeout_s)
            if self.shm_path is not None:
                self.group.shm = shm_allreduce.ShmAllReduce(self.shm_path, 0, world, slot, self.timeout_s,
                                                            peers_alive=self._dead_ranks)
            self.model = TensorParallelModel(mc, loaded.state_dict, self.plan, 0, self.group, dtype, device,
                                             max_positions=max_model_len, switches=config)
            self._wait_for("ready", deadline)
        except BaseException:
            self.broken = "start-up failed"
            self._reap(force=True)
            raise
        finally:
            if self.shm_path is not None:        # every rank mapped it (or failed): no file is left behind
                try:
                    os.unlink(self.shm_path)
                except FileNotFoundError:
                    pass
        self.model.driver = self

    def bind(self, engine) -> None:
        self.engine_ref = weakref.ref(engine)

    # ---- the step protocol -------------------------------------------------------------------
    def view(self, batch=None) -> RankView:
        """Rank 0's view: the engine's own bound table, batch, sequences and pool."""
        eng = self.engine_ref()
        batch = batch if batch is not None else self.last_batch
        seqs = list(batch.seqs) if batch is not None else []
        lists = {s.request_id: s.pages for s in eng.scheduler.running if s.pages}
        lists.update({s.request_id: s.pages for s in seqs})
        rids = np.fromiter((s.request_id for s in seqs), np.int64, len(seqs))
        ref = np.frombuffer(eng.pool.ref, dtype=np.int64) if len(eng.pool.ref) else np.zeros(0, np.int64)
        return RankView(0, self.world, eng.step_count, eng.builder.block_tables, batch, rids, lists, ref,
                        eng.pool.num_pages)

    def forward(self, batch, kv, attn) -> torch.Tensor:
        with self.lock:
            return self._forward(batch, kv, attn)

    def _forward(self, batch, kv, attn) -> torch.Tensor:
        self._check_usable()
        eng = self.engine_ref()
        g = self.group
        step = eng.step_count
        flags = (pb.FLAG_STATS if eng.bus.wants(RankStepFinished) else 0) | (pb.FLAG_TAPS if self.taps else 0)
        t0 = time.perf_counter_ns()
        g.comm_ns = g.comm_bytes = 0
        try:
            updates, n = self.tracker.updates(batch.seqs, eng.scheduler.running)
            h, payload, _ = pb.encode_step(step, batch, updates, n, flags)
            g.broadcast(h, 0)
            g.broadcast(payload, 0)
            self.last_batch = batch
            logits = self.model.local_forward(batch, kv, attn)
            self.steps += 1
            stats = tapped = None
            if flags & pb.FLAG_STATS:
                nbytes = step_bytes(eng.weight_bytes, batch, kv, self.shard_config)
                mine = stats_vector(0, time.perf_counter_ns() - t0, g, nbytes, eng.builder.block_tables)
                stats = g.gather(mine, 0)
            if flags & pb.FLAG_TAPS:
                tapped = self._gather_taps(batch)
        except RankFailed:
            raise
        except BaseException as e:          # noqa: BLE001 - KeyboardInterrupt too: the group is mid-step
            self._fail(e, f"step {step}")
        # The step's collectives are done: what listeners do now cannot desync the ranks.
        if stats is not None:
            self._emit_stats(eng, step, stats)
        for callback, digests, dt in tapped or ():
            callback(step, digests, dt)
        return logits

    def _emit_stats(self, eng, step: int, rows) -> None:
        t = now_ns()
        for v in rows:
            r, dt, comm, nbytes, cbytes, tcrc, ver, b, w = (int(x) for x in v[:STATS_FIELDS])
            eng.bus.emit(RankStepFinished(step, t, r, dt, comm, nbytes, cbytes, tcrc, ver, b, w))

    def _gather_taps(self, batch) -> list[tuple]:
        """(callback, [world, size] values, ns the tap took) per tap, in the workers' order (by name)."""
        view = self.view(batch)
        out = []
        for name in sorted(self.taps):
            fn, size, callback = self.taps[name]
            t0 = time.perf_counter_ns()
            got = self.group.all_gather(_tap_values(fn, view, size, self.store))
            out.append((callback, torch.stack(got).numpy(), time.perf_counter_ns() - t0))
        return out

    # ---- control and calls (between steps, or from a tap's callback) -----------------------------
    def control(self, msg: dict) -> None:
        """Send a control message to every rank (see worker.Worker.control); raises naming a rank
        that could not apply it."""
        with self.lock:
            self._control(msg)

    def _control(self, msg: dict) -> None:
        self._check_usable()
        try:
            payload = pb.json_payload(msg)
            self.group.broadcast(pb.header(pb.CMD_CONTROL, payload_len=payload.numel()), 0)
            self.group.broadcast(payload, 0)
            acks = self.group.all_gather(torch.tensor([1], dtype=torch.int64))
        except BaseException as e:          # noqa: BLE001
            self._fail(e, f"control {msg.get('op')!r}")
        bad = [r for r, a in enumerate(acks) if int(a[0]) != 1]
        if bad:
            errs = [f"rank {r}: {self.store.get(f'error/control/{r}').decode()}" for r in bad]
            raise RuntimeError(f"control {msg} failed on {'; '.join(errs)}")

    def add_tap(self, name: str, fn_path: str, size: int, callback: Callable) -> None:
        """Run fn (named 'module:function') on every rank after every forward, over that rank's
        RankView; its `size` int64 values are all-gathered and callback(step, [world, size] array,
        exchange_ns) runs here. The consistency probe's digests travel this way."""
        fn = load_function(fn_path)
        with self.lock:                     # the workers and the driver start tapping at the same step
            try:
                self.control({"op": "tap", "name": name, "fn": fn_path, "size": int(size)})
            except RuntimeError:            # a rank could not load it: no rank keeps it
                if self.broken is None:
                    self.control({"op": "untap", "name": name})
                raise
            self.taps[name] = (fn, int(size), callback)

    def remove_tap(self, name: str) -> None:
        with self.lock:
            if name in self.taps:
                del self.taps[name]
                if self.broken is None and not self.closed:
                    self.control({"op": "untap", "name": name})

    def call(self, fn_path: str, **kwargs) -> list[np.ndarray]:
        """fn(view, **kwargs) on every rank (rank 0 included, over the last step's view); each rank's
        int64 vector, in rank order. For a probe that found a mismatch and fetches the rows."""
        with self.lock:
            return self._call(fn_path, **kwargs)

    def _call(self, fn_path: str, **kwargs) -> list[np.ndarray]:
        self._check_usable()
        fn = load_function(fn_path)
        try:
            payload = pb.json_payload({"fn": fn_path, "kwargs": kwargs})
            self.group.broadcast(pb.header(pb.CMD_CALL, payload_len=payload.numel()), 0)
            self.group.broadcast(payload, 0)
            try:
                mine = torch.as_tensor(np.asarray(fn(self.view(), **kwargs), dtype=np.int64).reshape(-1))
                size = mine.numel()
            except Exception as e:           # noqa: BLE001 - the workers still expect the collectives
                mine, size, err0 = torch.zeros(0, dtype=torch.int64), -1, e
            sizes = [int(s[0]) for s in self.group.all_gather(torch.tensor([size], dtype=torch.int64))]
            width = max(1, max(sizes))
            got = self.group.gather(_fixed(mine, width, pad=True), 0)
        except BaseException as e:           # noqa: BLE001
            self._fail(e, f"call {fn_path}")
        if sizes[0] < 0:
            raise err0
        bad = [r for r, s in enumerate(sizes) if s < 0]
        if bad:
            errs = [f"rank {r}: {self.store.get(f'error/call/{r}').decode()}" for r in bad]
            raise RuntimeError(f"call {fn_path} failed on {'; '.join(errs)}")
        return [g.numpy()[:s].copy() for g, s in zip(got, sizes)]

    def set_table_source(self, rank: int, mode: str, drop_rows=()) -> None:
        """The workers' seam (worker.Worker.table_source): 'broadcast' (bind the driver's table,
        crc-checked) or 'host_copy' (bind the rank's own host copy; drop_rows lose updates)."""
        if not 1 <= rank < self.world:
            raise ValueError(f"rank must be a worker rank in [1, {self.world}), got {rank}: rank 0 is the source")
        self.control({"op": "table_source", "rank": rank, "mode": mode, "drop_rows": [int(r) for r in drop_rows]})

    def resync(self) -> None:
        """Every rank drops its host copy; the next plan carries every live page list in full."""
        with self.lock:
            self.control({"op": "resync"})
            self.tracker.resync()

    # ---- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the workers down and reap them (idempotent)."""
        if self.closed:
            return
        got = self.lock.acquire(timeout=JOIN_TIMEOUT_S)     # a step in flight on another thread ends first
        try:
            if self.closed:
                return
            self.closed = True
            if got and self.broken is None and getattr(self, "group", None) is not None:
                try:
                    self.group.broadcast(pb.header(pb.CMD_SHUTDOWN), 0)
                except Exception:            # noqa: BLE001 - a rank already gone: reaped below
                    pass
            self._reap(force=self.broken is not None or not got)
            _LIVE.discard(self)
        finally:
            if got:
                self.lock.release()

    def _reap(self, force: bool) -> None:
        procs = [p for p in self.procs.values() if p is not None]
        t_end = time.monotonic() + (0.0 if force else JOIN_TIMEOUT_S)
        for p in procs:
            p.join(max(0.0, t_end - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(3.0)
            if p.exitcode is None:
                p.kill()
                p.join(3.0)
        group = getattr(self, "group", None)
        if group is not None:
            group.close()
        if self.torchrun and force:          # torchrun's ranks are not our children: signal them
            for r, pid in self.pids.items():
                try:
                    os.kill(pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        torch.set_num_threads(self._old_threads)

    def worker_pids(self) -> list[int]:
        return [self.pids[r] for r in sorted(self.pids)]
