"""A worker rank: its shard of the model and of the KV pool, serving the driver's plans.

Started by the driver (torch.multiprocessing, start method spawn: spawn_main) or by torchrun
(serve_torchrun, from `python -m workbench.serve` on every rank but 0). It meets the others
at the store, reads the engine's configuration there (JSON, written by the driver: one
configuration for every rank), loads the model from the same path, keeps its own shard, and
then runs, until the driver says stop:

    wait for the next header -> the plan -> apply the page-table updates to its host copy ->
    bind the table (the driver's bytes, crc-checked; or its host copy's rows, see below) ->
    forward over its heads (all-reduces, the logits gather) -> report (RankStepFinished
    numbers, the per-step taps' vectors)

Seam (the rank_desync fault switches it, through a control message): `table_source`.
"broadcast" (the default and the fix) binds the driver's table; "host_copy" binds the rows
this rank's own host copy makes, the production setup of field note 9, and `drop_rows` lose
the updates of requests in those batch rows (the update that never arrived). `dropped` keeps
what was lost (step, request, row, pages it would have mapped), for the fault's report.

A worker dies with its driver: PR_SET_PDEATHSIG on Linux, and a watcher thread that notices
the parent's pid change elsewhere; it ignores SIGINT (an interrupted notebook kernel is the
driver's to handle), and any error it hits is written to the store under error/<rank> before
it exits, so the driver can name it.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from . import plan_broadcast as pb
from .group import DEFAULT_TIMEOUT_S, Group, join_store, pid_alive, torchrun_store
from .shm_allreduce import ShmAllReduce


@dataclass
class RankView:
    """What one rank holds after a forward, as a per-step tap or a call sees it (the same shape on
    the driver, whose rank-0 view reads the engine's own state)."""
    rank: int
    world: int
    step: int
    block_tables: Any              # this rank's BlockTables: .view() is the bound buffer its kernels read
    batch: Any                     # this rank's PackedBatch of the step (slot_mapping, ...)
    request_ids: np.ndarray        # [B] the request in each row
    page_lists: Mapping[int, Any]  # request id -> page list (rank 0: the sequences'; workers: the host copy)
    ref: np.ndarray                # [num_pages] live page lists mapping each page (rank 0: the pool's refcounts)
    num_pages: int
    table_source: str = "broadcast"


def load_function(path: str):
    """'package.module:function' -> the function (per-step taps and calls name theirs this way)."""
    mod, _, name = path.partition(":")
    if not mod or not name:
        raise ValueError(f"a function is named 'module:function', not {path!r}")
    return getattr(importlib.import_module(mod), name)


def as_vector(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64).reshape(-1))


def stats_vector(rank: int, dt_ns: int, group: Group, nbytes: int, bt) -> torch.Tensor:
    b, w = bt.shape
    table_crc = pb.crc(bt.view((b, w)).detach().to("cpu").numpy()) if b else 0
    return torch.tensor([rank, dt_ns, group.comm_ns, nbytes, group.comm_bytes, table_crc, bt.version, b, w],
                        dtype=torch.int64)


STATS_FIELDS = 9


def step_bytes(weight_bytes: int, batch, kv, mc_local) -> int:
    """Bytes this rank's forward streams: its weights, the KV pages it reads, the K/V it writes."""
    plan = batch.attn_plan
    pages = plan.pages_read if plan is not None else 0
    elem = kv.k[0].element_size()
    written = batch.num_tokens * 2 * mc_local.num_kv_heads * mc_local.head_dim * elem * mc_local.num_layers
    return weight_bytes + pages * kv.bytes_per_page + written


class Worker:
    def __init__(self, store, rank: int, world: int, cfg: dict, group: Group):
        from ..config import EngineConfig
        from ..kv_cache import torch_dtype
        from ..model_config import ModelConfig
        from ..stack import build_stack
        from ..weights import load_model
        from .shard import TensorParallelModel, plan_shards, shard_config
        self.store, self.rank, self.world, self.group = store, rank, world, group
        self.config = config = EngineConfig(**cfg["engine_config"])
        if cfg.get("num_threads"):
            torch.set_num_threads(int(cfg["num_threads"]))
        dtype = torch_dtype(config.dtype)
        loaded = load_model(cfg["model_path"], dtype)
        mc = loaded.config
        want = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg["model_config"].items()})
        if mc != want:
            raise RuntimeError(f"rank {rank} loaded {cfg['model_path']} as {mc}, the driver as {want}")
        self.plan = plan_shards(mc, world)
        self.mc_local = shard_config(mc, self.plan, rank)
        self.model = TensorParallelModel(mc, loaded.state_dict, self.plan, rank, group, dtype, "cpu",
                                         max_positions=cfg["max_model_len"], switches=config)
        del loaded
        self.num_pages = int(cfg["num_pages"])
        stack = build_stack(config, self.num_pages, self.mc_local, torch.device("cpu"), cfg["max_model_len"])
        self.kv, self.builder, self.attn = stack.kv, stack.builder, stack.attn
        self.page_size = config.page_size
        self.weight_bytes = self.model.layer_bytes + self.model.lm_head.nbytes
        self.host = pb.HostCopy(self.num_pages)
        self.table_source = "broadcast"
        self.drop_rows: frozenset[int] = frozenset()
        self.dropped: list[tuple[int, int, int, int]] = []
        self.taps: dict[str, Any] = {}
        self.step = 0
        self.batch = None
        self.request_ids = np.zeros(0, dtype=np.int64)

    def view(self) -> RankView:
        return RankView(self.rank, self.world, self.step, self.builder.block_tables, self.batch, self.request_ids,
                        self.host.pages, self.host.ref, self.num_pages, self.table_source)

    # ---- the loop ------------------------------------------------------------------------
    def serve(self) -> None:
        g = self.group
        while True:
            h = torch.zeros(pb.HEADER, dtype=torch.int64)
            g.broadcast(h, 0, idle=True)
            cmd, n = int(h[0]), int(h[6])
            if cmd == pb.CMD_SHUTDOWN:
                return
            if cmd == pb.CMD_STEP:
                self.run_step(h)
            elif cmd in (pb.CMD_CONTROL, pb.CMD_CALL):
                payload = g.broadcast(torch.empty(n, dtype=torch.uint8), 0)
                msg = pb.read_json(payload)
                (self.control if cmd == pb.CMD_CONTROL else self.call)(msg)
            else:
                raise RuntimeError(f"rank {self.rank}: unknown command {cmd} from the driver")

    def run_step(self, h: torch.Tensor) -> None:
        g = self.group
        t0 = time.perf_counter_ns()
        g.comm_ns = g.comm_bytes = 0
        payload = g.broadcast(torch.empty(int(h[6]), dtype=torch.int64), 0)
        plan = pb.decode_step(h, payload)
        self.step = plan.step
        rows = {rid: i for i, rid in enumerate(plan.request_ids.tolist())}
        for rid, pages in self.host.records(plan.updates):
            row = rows.get(rid)
            if pages is not None and row is not None and row in self.drop_rows:
                self.dropped.append((plan.step, rid, row, len(pages)))      # the update that never arrived
                continue
            self.host.apply(rid, pages)
        if self.table_source == "broadcast":
            got = pb.crc(plan.table)
            if got != plan.table_crc:
                raise RuntimeError(f"rank {self.rank}: the block table received for step {plan.step} has crc "
                                   f"{got:#010x}, the driver sent {plan.table_crc:#010x}")
            table = plan.table
        else:
            table = self.host.rows(plan.request_ids, plan.table.shape[1])
        self.request_ids = plan.request_ids.copy()
        self.batch = batch = pb.build_batch(self.builder, plan, table, self.page_size)
        self.model.local_forward(batch, self.kv, self.attn)
        if plan.flags & pb.FLAG_STATS:
            nbytes = step_bytes(self.weight_bytes, batch, self.kv, self.mc_local)
            g.gather(stats_vector(self.rank, time.perf_counter_ns() - t0, g, nbytes, self.builder.block_tables), 0)
        if plan.flags & pb.FLAG_TAPS:
            view = self.view()
            for name in sorted(self.taps):
                fn, size = self.taps[name]
                g.all_gather(_tap_values(fn, view, size, self.store))

    def control(self, msg: dict) -> None:
        ok = 1
        try:
            op = msg["op"]
            if op == "tap":
                self.taps[msg["name"]] = (load_function(msg["fn"]), int(msg["size"]))
            elif op == "untap":
                self.taps.pop(msg["name"], None)
            elif op == "table_source":
                if msg.get("rank") in (None, self.rank):
                    if msg["mode"] not in ("broadcast", "host_copy"):
                        raise ValueError(f"table_source {msg['mode']!r} is not 'broadcast' or 'host_copy'")
                    if msg["mode"] == "host_copy" and self.table_source != "host_copy":
                        self.dropped.clear()          # a new drift: its own record
                    self.table_source = msg["mode"]
                    self.drop_rows = frozenset(int(r) for r in (msg.get("drop_rows") or ()))
            elif op == "resync":
                self.host.clear()
            else:
                raise ValueError(f"unknown control op {op!r}")
        except Exception as e:                   # noqa: BLE001 - reported to the driver, the loop goes on
            ok = 0
            self.store.set(f"error/control/{self.rank}", f"{type(e).__name__}: {e}")
        self.group.all_gather(torch.tensor([ok], dtype=torch.int64))

    def call(self, msg: dict) -> None:
        try:
            out = as_vector(load_function(msg["fn"])(self.view(), **msg.get("kwargs", {})))
            size = out.numel()
        except Exception as e:                   # noqa: BLE001
            self.store.set(f"error/call/{self.rank}", f"{type(e).__name__}: {e}")
            out, size = torch.zeros(0, dtype=torch.int64), -1
        sizes = self.group.all_gather(torch.tensor([size], dtype=torch.int64))
        width = max(1, max(int(s) for s in sizes))
        self.group.gather(_fixed(out, width, pad=True), 0)


def _tap_values(fn, view: RankView, size: int, store=None) -> torch.Tensor:
    """fn(view) as `size` int64; a tap that fails sends -1s (the collective still happens: the ranks
    stay in step) and leaves its error in the store under error/tap/<rank>."""
    try:
        return _fixed(fn(view), size)
    except Exception as e:                       # noqa: BLE001 - a tap's bug must not break the group
        if store is not None:
            store.set(f"error/tap/{view.rank}", f"{type(e).__name__}: {e}")
        return torch.full((size,), -1, dtype=torch.int64)


def _fixed(values, size: int, pad: bool = False) -> torch.Tensor:
    v = as_vector(values)
    if v.numel() != size:
        if not pad and v.numel() > size:
            raise ValueError(f"a tap returned {v.numel()} values, it declared {size}")
        v = torch.cat([v[:size], torch.zeros(max(0, size - v.numel()), dtype=torch.int64)])
    return v


def dropped_updates(view: RankView) -> np.ndarray:
    """A call (Driver.call) for the rank_desync fault's report: [step, request, row, pages] of every
    update this rank lost, flattened. Rank 0 loses none."""
    w = _CURRENT
    if w is None or not w.dropped:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(w.dropped, dtype=np.int64).reshape(-1)


_CURRENT: Worker | None = None


# ---- process entry points --------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Exit when the driver does: the kernel's parent-death signal on Linux, a watcher elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:             # the driver died before the signal was armed
        os._exit(1)

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)
    threading.Thread(target=watch, name="pagedkv-parent-watch", daemon=True).start()


def run(store, rank: int, world: int, timeout_s: float) -> int:
    """Meet the others, load, serve; returns the exit code (errors are left in the store)."""
    global _CURRENT
    try:
        store.set(f"hello/{rank}", str(os.getpid()))
        cfg = json.loads(store.get("config").decode())
        group = Group(store, rank, world, float(cfg.get("timeout_s", timeout_s)))
        if cfg.get("shm_path"):
            pids = {r: int(store.get(f"hello/{r}").decode()) for r in range(world) if r != rank}
            group.shm = ShmAllReduce(cfg["shm_path"], rank, world, int(cfg["shm_slot_bytes"]), group.timeout_s,
                                     peers_alive=lambda: [r for r, pid in pids.items() if not pid_alive(pid)])
        worker = _CURRENT = Worker(store, rank, world, cfg, group)
        store.set(f"ready/{rank}", "1")
        worker.serve()
        group.close()
        return 0
    except BaseException as e:                   # noqa: BLE001 - named to the driver, then exit
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        try:
            store.set(f"error/{rank}", msg)
        except Exception:                        # noqa: BLE001 - the driver (and its store) may be gone
            pass
        print(f"pagedkv worker rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def spawn_main(rank: int, world: int, port: int, parent_pid: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """The target of the driver's spawned processes."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = join_store(port, world, timeout_s)
    code = run(store, rank, world, timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_torchrun(timeout_s: float | None = None) -> int:
    """A rank other than 0 under torchrun: serve the driver (rank 0) until it shuts down. Until the
    driver's config arrives the rendezvous waits PAGEDKV_TP_TIMEOUT_S (EngineConfig.tp_timeout_s's default)."""
    if timeout_s is None:
        from .. import env
        timeout_s = env.value("PAGEDKV_TP_TIMEOUT_S")
    store, rank, world = torchrun_store(timeout_s)
    if rank == 0:
        raise RuntimeError("rank 0 drives: build the Engine there (workbench.serve does)")
    return run(store, rank, world, timeout_s)
