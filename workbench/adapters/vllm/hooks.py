"""Where the plugin hooks vLLM, installed once per process; each hook on its own, none fatal.

On what every step path and every model runner shares (issue 26):

  engine core   Scheduler.schedule / Scheduler.update_from_output (and subclasses: the
                AsyncScheduler, any platform's): both EngineCore.step and
                EngineCore.step_with_batch_queue (async scheduling, pipeline parallel) call
                them. Scheduler.__init__ reports which path vLLM picked (the status line).
  worker        AttentionMetadataBuilder.build on every backend's builder (CPU, CUDA,
                vllm-ascend, v1 and v2 runners), now and as later imports define them,
                and update_block_table (the V1 runner's shortcut for a further KV cache
                group of the same spec on CUDA backends: metadata made without build);
                execute_model on every model runner class that defines it (V1 GPU / CPU,
                V2, NPUModelRunner) for the step's SchedulerOutput; the V2 runner's
                prepare_inputs for its row order; initialize_kv_cache for the status line
                and, once the KV cache exists, each attention layer's impl.forward (the
                attention check, attention_watch.py: an instance attribute per layer).
  fault seams   (only when PAGEDKV_VLLM_FAULT_FILE names a file; otherwise no vLLM function is
                replaced for fault injection) Scheduler._free_request_blocks (faults.py's abort leak), kv_cache_utils.
                hash_block_tokens (its prefix-hash fault), KVCacheManager.allocate_slots
                (its admission fault), SlidingWindowManager.get_num_skipped_tokens (the
                window fault), BlockPool.touch (the hit-reference fault), the SchedulerOutput
                execute_model hands the runner (the resume fault); AttentionImpl.forward and
                do_kv_cache_update (the attention math faults). The add_loses_request fault
                lives in the request books' Scheduler.add_request hook, acting only with a fault file.

A hook whose target vLLM lacks (another version) is skipped with a status line saying so;
the rest install. Every callback runs inside try/except: an exception of ours is one log
line, and vLLM's own call always runs with vLLM's own arguments.
"""
from __future__ import annotations

import functools
import time

from . import faults
from . import status as st
from .attention_watch import AttentionWatch
from .engine_side import PoolWatch
from .patching import wrap_family
from .reporter import Reporter
from .request_watch import RequestWatch
from .worker_side import MetadataWatch

_installed = False
REP: Reporter | None = None
POOL: PoolWatch | None = None
META: MetadataWatch | None = None
ATTN: AttentionWatch | None = None
REQ: RequestWatch | None = None
FAULTY = False                 # a fault file is named: the seams are installed


def install(settings) -> None:
    global _installed, REP, POOL, META, ATTN, REQ, FAULTY
    if _installed:
        return
    _installed = True
    REP = Reporter(settings.address)
    POOL = PoolWatch(REP, settings)
    META = MetadataWatch(REP, settings)
    ATTN = AttentionWatch(REP, settings, META)
    REQ = RequestWatch(REP)
    FAULTY = bool(settings.fault_file)
    # the fault seams replace vLLM functions: only when a fault file is named (a test, a notebook), never
    # in a production server, whose functions stay vLLM's own
    seams = (("fault seams", _seams), ("attention fault seams", _attention_seams)) if settings.fault_file else ()
    for name, fn in (("engine core hooks", _engine_core), ("worker hooks", _worker), *seams):
        try:
            fn()
        except Exception as e:                   # another vLLM: say what did not match, install the rest
            check = {"engine core hooks": st.CHECK_POOL, "worker hooks": st.CHECK_METADATA}.get(name, st.CHECK_FAULTS)
            REP.status(st.CheckStatus(check, False, reason=f"{name} not installed: {type(e).__name__}: {e} "
                                                           f"(vLLM {_vllm_version()})"))


def _vllm_version() -> str:
    try:
        import vllm
        return getattr(vllm, "__version__", "?")
    except Exception:
        return "?"


def _need(wrapped: list[str], what: str) -> None:
    """A hook the check cannot do without: its absence makes the check's status NOT active."""
    if not wrapped:
        raise AttributeError(f"{what} is not in this vLLM")


def _guard(where: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        REP.error(where, e)


def _after(where: str, callback):
    """A hook that runs vLLM's call, then callback(self, its result) (outermost calls only)."""
    def make(orig):
        def hook(self, *a, outer, **kw):
            out = orig(self, *a, **kw)
            if outer:
                _guard(where, callback, self, out)
            return out
        return hook
    return make


def _draining(make):
    """The hook `make` builds, after the checks' thread has drained: vLLM's call is about to change
    the scheduler or the pool that the checks read (aside.py)."""
    def wrap(orig):
        inner = make(orig)

        def hook(self, *a, outer, **kw):
            if outer:
                _guard("checks' thread", POOL.drain)
            return inner(self, *a, outer=outer, **kw)
        return hook
    return wrap


def _plain(orig):
    def hook(self, *a, outer, **kw):
        return orig(self, *a, **kw)
    return hook


def _engine_core() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(orig):
        def hook(self, *a, outer, **kw):
            t0 = time.perf_counter()
            so = orig(self, *a, **kw)
            if outer:
                _guard("pool ledger", POOL.on_schedule, self, so, t0)
            return so
        return hook

    def update_from_output(orig):
        def hook(self, scheduler_output, *a, outer, **kw):
            out = orig(self, scheduler_output, *a, **kw)
            if outer:
                _guard("request books", REQ.on_update, self, out)
                _guard("pool check", POOL.on_update, self, scheduler_output, out)
            return out
        return hook

    def add_request(orig):
        def hook(self, request, *a, outer, **kw):
            new = outer and request.request_id not in self.requests
            out = orig(self, request, *a, **kw)
            if new:
                _guard("request books", REQ.on_add, self, request)
                if FAULTY:                            # the add_loses_request seam: only with a fault file
                    _guard("fault seam (add)", _lose_at_add, self, request)
            return out
        return hook

    _need(wrap_family(Scheduler, "schedule", _draining(schedule)), "Scheduler.schedule")
    _need(wrap_family(Scheduler, "update_from_output", _draining(update_from_output)),
          "Scheduler.update_from_output")
    wrap_family(Scheduler, "add_request", _draining(add_request))
    wrap_family(Scheduler, "finish_requests", _draining(_after("request books", REQ.on_finish_requests)))
    # the scheduler's reset may preempt every running request before it reaches the pool's
    wrap_family(Scheduler, "reset_prefix_cache", _draining(_plain))
    # vLLM's prefix-cache reset (an RLHF weight update, a benchmark harness): every path to it (the
    # scheduler's, the KV cache manager's) ends in the block pool's, so that is the one hooked
    from vllm.v1.core.block_pool import BlockPool
    wrap_family(BlockPool, "reset_prefix_cache", _draining(_after("prefix reset", POOL.on_prefix_reset)))
    # not EngineCore.__init__: vLLM loads plugins inside it, too late to wrap the running call
    wrap_family(Scheduler, "__init__", _after("status", lambda sched, _: POOL.on_scheduler_ready(sched)))


def _lose_at_add(scheduler, request) -> None:
    if faults.lose_at_add(META.switch, request):
        scheduler.waiting.remove_request(request)


def _runner_bases() -> list[type]:
    """The model runner families this vLLM has: V1 (GPU, CPU, NPU v1 subclass it), V2 (NPU v2)."""
    bases = []
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1
    bases.append(V1)
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
        bases.append(V2)
    except Exception as e:                       # the V2 runner needs what this build may lack
        st.problem(f"the V2 model runner is not importable here ({type(e).__name__}: {e}); "
                   f"its metadata is checked only where it imports")
    return bases


def _worker() -> None:
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    def execute_model(orig):
        def hook(self, scheduler_output=None, *a, outer, **kw):
            if outer:
                _guard("metadata ledger", META.on_execute, self, scheduler_output, bool(kw.get("dummy_run")))
                try:
                    scheduler_output = faults.worker_output(META.switch, scheduler_output)
                except Exception as e:
                    REP.error("fault seam (worker output)", e)
            return orig(self, scheduler_output, *a, **kw)
        return hook

    def build(orig):
        def hook(self, *a, outer, **kw):
            if not outer:
                return orig(self, *a, **kw)
            a = list(a)
            if "common_attn_metadata" in kw:
                kw["common_attn_metadata"] = META.on_build(self, kw["common_attn_metadata"])
            elif len(a) >= 2:                     # build(common_prefix_len, common_attn_metadata, ...)
                a[1] = META.on_build(self, a[1])
            return orig(self, *a, **kw)
        return hook

    def update_block_table(orig):
        def hook(self, metadata, blk_table, slot_mapping, *a, outer, **kw):
            if outer:
                _guard("metadata check", META.on_update_table, self, blk_table, slot_mapping)
            return orig(self, metadata, blk_table, slot_mapping, *a, **kw)
        return hook

    for base in _runner_bases():
        _need(wrap_family(base, "execute_model", execute_model), f"{base.__module__}.{base.__name__}.execute_model")
        wrap_family(base, "initialize_kv_cache", _after("status", _runner_ready))
        if "prepare_inputs" in base.__dict__:
            wrap_family(base, "prepare_inputs", _after("metadata row order", lambda _, batch: META.on_inputs(batch)))
    _need(wrap_family(AttentionMetadataBuilder, "build", build), "AttentionMetadataBuilder.build")
    wrap_family(AttentionMetadataBuilder, "update_block_table", update_block_table)


def _runner_ready(runner, _) -> None:
    META.on_runner_ready(runner)
    _guard("attention check (install)", ATTN.on_runner_ready, runner)


def _attention_seams() -> None:
    from vllm.v1.attention.backend import AttentionImpl

    def forward(orig):
        def hook(self, *a, outer, **kw):
            if not outer:
                return orig(self, *a, **kw)
            return faults.attention_forward(META.switch, orig, self, *a, **kw)
        return hook

    def write(orig):
        def hook(self, layer, key, value, *a, outer, **kw):
            if outer:
                try:
                    key, value = faults.kv_write(META.switch, key, value)
                except Exception as e:
                    REP.error("fault seam (kv write)", e)
            return orig(self, layer, key, value, *a, **kw)
        return hook

    wrap_family(AttentionImpl, "forward", forward)
    wrap_family(AttentionImpl, "do_kv_cache_update", write)


def _none_when(where: str, fault):
    """A seam that makes the wrapped call do nothing (return None) for a request the fault picks."""
    def make(orig):
        def hook(self, request, *a, outer, **kw):
            try:
                skip = outer and fault(META.switch, request)
            except Exception as e:
                REP.error(f"fault seam ({where})", e)
                skip = False
            return None if skip else orig(self, request, *a, **kw)
        return hook
    return make


def _seams() -> None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    wrap_family(Scheduler, "_free_request_blocks", _none_when("free", faults.skip_free))
    # None from allocate_slots: vLLM's "no room", so the request keeps waiting
    wrap_family(KVCacheManager, "allocate_slots", _none_when("admission", faults.refuse_admission))

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    def skipped(orig):
        def hook(self, num_computed_tokens, *a, outer, **kw):
            n = orig(self, num_computed_tokens, *a, **kw)
            try:
                return faults.window_skipped(META.switch, n, self.block_size) if outer else n
            except Exception as e:
                REP.error("fault seam (window)", e)
                return n
        return hook

    def touch(orig):
        def hook(self, blocks, *a, outer, **kw):
            try:
                keep = faults.hit_refs_kept(META.switch, blocks) if outer else []
            except Exception as e:
                REP.error("fault seam (touch)", e)
                keep = []
            out = orig(self, blocks, *a, **kw)
            for b in keep:
                b.ref_cnt -= 1
            return out
        return hook

    wrap_family(SlidingWindowManager, "get_num_skipped_tokens", skipped)
    wrap_family(BlockPool, "touch", touch)
    # the block hasher looks hash_block_tokens up in its module at each call
    hash_block_tokens = kv_cache_utils.hash_block_tokens

    @functools.wraps(hash_block_tokens)          # vLLM's function stays reachable (__wrapped__)
    def hashed(hash_function, parent_block_hash, curr_block_token_ids, *a, **kw):
        try:
            curr_block_token_ids = faults.block_tokens(META.switch, curr_block_token_ids)
        except Exception as e:
            REP.error("fault seam (block hash)", e)
        return hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, *a, **kw)

    kv_cache_utils.hash_block_tokens = hashed
