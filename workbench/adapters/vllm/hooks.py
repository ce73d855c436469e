"""Where the plugin wraps vLLM (0.32, V1 engine), and how it reads vLLM's state for the checks.

Three wraps, each a thin call around vLLM's own method, installed once per process:

  EngineCore.step              after each step (engine-core process): the block pool
                               against the KV cache manager and the scheduler, a pool
                               snapshot for the page map, the step's time
  GPUModelRunner.execute_model (worker process): remembers the runner and this step's
                               SchedulerOutput while the step builds its metadata
  AttentionGroup.build_metadata every backend's metadata build goes through it with vLLM's
                               CommonAttentionMetadata (CPU, CUDA and vllm-ascend alike):
                               checked before the backend builds from it

and one fault seam (Scheduler._free_request_blocks) that faults.py uses. Everything
vLLM-specific is read here; the checks themselves are sanitizer.py's. A check that fails
to run sends an error and vLLM carries on: the plugin never breaks the engine it watches.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np

from . import faults, sanitizer
from .stream import Publisher

_installed = False


class _State:
    """Per process: the publisher (made on first use), counters and what was already reported."""

    def __init__(self, address: str, pool_every: int, fault_file: str | None):
        self.address = address
        self.pool_every = max(1, pool_every)
        self.switch = faults.FaultSwitch(fault_file)
        self.pub: Publisher | None = None
        self.step = 0                         # engine steps seen (engine-core process)
        self.worker_step = 0                  # model executions seen (worker process)
        self.current = None                   # (runner, scheduler_output) while a step executes
        self.checked = False                  # this step's metadata already checked
        self.names: dict[str, int] = {}       # request id -> owner index, for the requests holding blocks
        self.next_name = 0
        self.last_holder: dict[int, str] = {}
        self.reported: set = set()            # persistent conditions are reported once
        self.check_s = 0.0
        self.checks = 0                       # metadata checks run (worker process)

    def publisher(self) -> Publisher:
        if self.pub is None:
            self.pub = Publisher(self.address)
            import vllm
            self.pub.send(b"hello", {"pid": os.getpid(), "process": multiprocessing.current_process().name,
                                     "vllm_version": getattr(vllm, "__version__", "?")})
            time.sleep(0.05)                  # let the connection settle so the first findings arrive
        return self.pub

    def report(self, findings: list[dict]) -> None:
        pub = self.publisher()
        for f in findings:
            if f["probe"] == sanitizer.PROBE_METADATA:        # once per request and tensor, not per step
                key = (f["probe"], f["kind"], f["evidence"].get("copy"), f["request_id"])
            else:
                key = (f["probe"], f["kind"], f["request_id"], f["page"])
            if key in self.reported:
                continue
            if len(self.reported) > 100_000:      # bounded: a fault left on for days must not grow vLLM
                self.reported.clear()
            self.reported.add(key)
            pub.send(b"finding", f)

    def error(self, where: str, e: BaseException) -> None:
        try:
            self.publisher().send(b"error", {"message": f"{where}: {type(e).__name__}: {e}", "step": self.step})
        except Exception:
            pass


STATE: _State | None = None


def install(address: str, pool_every: int = 1, fault_file: str | None = None) -> None:
    global _installed, STATE
    if _installed:
        return
    _installed = True
    STATE = _State(address, pool_every, fault_file)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    step, execute, build, free_blocks = (EngineCore.step, GPUModelRunner.execute_model,
                                         AttentionGroup.build_metadata, Scheduler._free_request_blocks)

    def engine_step(self, *a, **kw):
        t0 = time.perf_counter()
        out = step(self, *a, **kw)
        dt = time.perf_counter() - t0
        try:
            after_step(self.scheduler, dt)
        except Exception as e:                # never into vLLM
            STATE.error("pool check", e)
        return out

    def execute_model(self, scheduler_output, *a, **kw):
        STATE.current, STATE.checked = (self, scheduler_output), False
        STATE.worker_step += 1
        try:
            return execute(self, scheduler_output, *a, **kw)
        finally:
            STATE.current = None

    def build_metadata(self, common_attn_metadata, *a, **kw):
        cm = common_attn_metadata
        try:
            cm = faults.metadata(STATE.switch, cm, self.kv_cache_spec.block_size)
            if STATE.current is not None and not STATE.checked:
                STATE.checked = True
                check_metadata(cm, *STATE.current, self.kv_cache_spec.block_size)
        except Exception as e:
            STATE.error("metadata check", e)
        return build(self, cm, *a, **kw)

    def free_request_blocks(self, request):
        if faults.skip_free(STATE.switch, request):
            return
        return free_blocks(self, request)

    EngineCore.step = engine_step
    GPUModelRunner.execute_model = execute_model
    AttentionGroup.build_metadata = build_metadata
    Scheduler._free_request_blocks = free_request_blocks


# ---- reading vLLM's state ---------------------------------------------------------------
def _np(t, n=None):
    a = t.detach().to("cpu") if hasattr(t, "detach") else t
    a = np.asarray(a)
    return a if n is None else a[:n]


def check_metadata(cm, runner, sched_out, block_size: int) -> None:
    t0 = time.perf_counter()
    n = int(cm.num_reqs)
    req_ids = list(runner.input_batch.req_ids[:n])
    computed = {d.req_id: d.num_computed_tokens for d in sched_out.scheduled_new_reqs}
    cached = sched_out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    starts = [computed.get(r, runner.requests[r].num_computed_tokens) for r in req_ids]
    q = [sched_out.num_scheduled_tokens.get(r, 0) for r in req_ids]
    pages = [list(runner.requests[r].block_ids[0]) for r in req_ids]
    t = int(cm.num_actual_tokens)
    kv_cfg = getattr(runner, "kv_cache_config", None)
    findings = sanitizer.metadata_findings(
        STATE.worker_step, req_ids, starts, q, pages, block_size, getattr(kv_cfg, "num_blocks", None),
        query_start_loc=_np(cm.query_start_loc_cpu, n + 1), seq_lens=_np(cm.seq_lens, n),
        block_table=_np(cm.block_table_tensor, n), slot_mapping=_np(cm.slot_mapping, t),
        positions=None if cm.positions is None else _np(cm.positions, t))
    STATE.check_s += time.perf_counter() - t0
    STATE.checks += 1
    if STATE.checks % 32 == 0:                # the worker sends no step headers: its cost travels alone
        STATE.publisher().send(b"cost", {"process": multiprocessing.current_process().name, "checks": 32,
                                         "check_s": STATE.check_s})
        STATE.check_s = 0.0
    if findings:
        STATE.report(findings)


def after_step(scheduler, step_s: float) -> None:
    STATE.step += 1
    idle = not scheduler.requests
    if STATE.step % STATE.pool_every and not idle:
        return
    t0 = time.perf_counter()
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    blocks = pool.blocks
    n = len(blocks)
    ref = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=n)
    has_hash = np.fromiter((b.block_hash is not None for b in blocks), dtype=bool, count=n)
    prev = np.fromiter((-1 if b.prev_free_block is None else b.prev_free_block.block_id for b in blocks),
                       dtype=np.int64, count=n)
    q = pool.free_block_queue
    walk, err, b = [], None, q.fake_free_list_head.next_free_block
    tail = q.fake_free_list_tail
    while b is not None and b is not tail:
        if len(walk) > n:
            err = "the free queue loops"
            break
        walk.append(b.block_id)
        b = b.next_free_block
    holders = {}
    for mgr in kvm.coordinator.single_type_managers[:1]:       # Llama-style models: one full-attention group
        for rid, bl in mgr.req_to_blocks.items():
            holders[rid] = [x.block_id for x in bl]
    null = getattr(pool.null_block, "block_id", None)
    index_errors = _index_errors(pool, blocks, has_hash)
    live = {rid: getattr(r.status, "name", str(r.status)) for rid, r in scheduler.requests.items()}
    computed = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    findings = sanitizer.pool_findings(STATE.step, ref, walk, err, prev, q.num_free_blocks, null, holders, live,
                                       index_errors, STATE.last_holder, scheduler.block_size, computed)
    for rid, pages in holders.items():
        for p in pages:
            STATE.last_holder[p] = rid
    # the snapshot: ref, first owner and cached-free flag per block, for the page map
    owner = np.full(n, -1, dtype=np.int32)
    new = {}
    names = {}                                # only the current holders: a server's lifetime of ids is not kept
    for rid, pages in holders.items():
        i = STATE.names.get(rid)
        if i is None:
            i = STATE.next_name
            STATE.next_name += 1
            new[i] = rid
        names[rid] = i
        idx = np.asarray(pages, dtype=np.int64)
        idx = idx[(idx >= 0) & (idx < n)]
        free_owner = owner[idx] < 0
        owner[idx[free_owner]] = i
    is_free = np.zeros(n, dtype=bool)
    is_free[[p for p in walk if 0 <= p < n]] = True
    cached = (is_free & has_hash).astype(np.uint8)
    STATE.names = names
    STATE.check_s += time.perf_counter() - t0
    pub = STATE.publisher()
    running, waiting = len(scheduler.running), len(scheduler.requests) - len(scheduler.running)
    extra = {}
    if idle:
        # At idle the prefix cache's block hashes, as vLLM's KV events spell them (its own
        # conversion): a consumer of those events can check its map against the pool itself.
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash
        extra["hashes"] = [maybe_convert_block_hash(get_block_hash(b.block_hash)) for b in blocks
                           if b.block_hash is not None]
        extra["hashes"] = [h if isinstance(h, int) else h.hex() for h in extra["hashes"]]
    pub.send(b"step", {"step": STATE.step, "t": time.time(), "step_s": step_s, "check_s": STATE.check_s,
                       "num_blocks": n, "block_size": scheduler.block_size, "num_free": q.num_free_blocks,
                       "running": running, "waiting": waiting, "hashed": int(has_hash.sum()),
                       "process": multiprocessing.current_process().name, "names": new, **extra},
             (ref.astype(np.int32), owner, cached))
    STATE.check_s = 0.0
    if findings:
        STATE.report(findings)


def _index_errors(pool, blocks, has_hash) -> tuple[list[int], list[int]]:
    """(index entries naming a block with another hash, hashed blocks the index lacks)."""
    cache = getattr(pool.cached_block_hash_to_block, "_cache", None)
    if cache is None:
        return [], []
    bad, indexed = [], set()
    for key, entry in cache.items():
        for blk in (entry.values() if isinstance(entry, dict) else (entry,)):
            indexed.add(blk.block_id)
            if blk.block_hash != key:
                bad.append(blk.block_id)
    missing = [int(i) for i in np.nonzero(has_hash)[0] if int(i) not in indexed]
    return bad[:16], missing[:16]
