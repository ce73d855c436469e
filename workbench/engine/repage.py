"""Swapping an engine's KV stack (pool, KV manager, scheduler, builder, KV tensors, attention
backend: stack.py) for another page size, and back. Live requests move like a preemption:
released from the old pool, re-queued on the new one, recomputed."""
from __future__ import annotations

from .kernel_selection import from_engine as kernel_selection
from .stack import KVStack, build_stack


def install(eng, stack: KVStack) -> None:
    """Make stack the engine's pool, scheduler, builder, KV cache and backend."""
    eng.stack = stack
    eng.config, eng.num_pages = stack.config, stack.num_pages
    eng.pool, eng.kv_manager, eng.scheduler = stack.pool, stack.kv_manager, stack.scheduler
    eng.kv, eng.builder, eng.attn = stack.kv, stack.builder, stack.attn
    eng.runner.install(stack)
    eng.step_record = None
    # Which kernels run (attention, linear, pool ops, bf16), read back from the parts just built:
    # decided here once, not per step; kvwb doctor and the dashboard show it.
    eng.kernels = kernel_selection(eng)
    hooks = getattr(eng, "model_hooks", None)
    if hooks is not None:                     # re-paged: rewire the pool observer and hooks
        from . import instrumentation
        hooks.kv_bytes_per_page_layer = eng.kv.bytes_per_page // max(1, eng.model_config.num_layers)
        instrumentation.refresh(eng)


def repage(eng, page_size: int, **config_changes) -> KVStack:
    if eng.parallel is not None:
        raise NotImplementedError("repage() with tensor_parallel_size > 1: every rank would need the new "
                                  "stack; build a new engine with that page size")
    cfg = eng.config.replace(page_size=page_size, **config_changes)
    num_pages = max(1, eng.num_pages * eng.config.page_size // page_size)
    return restore_stack(eng, build_stack(cfg, num_pages, eng.model_config, eng.device, eng.max_model_len))


def restore_stack(eng, stack: KVStack) -> KVStack:
    with eng.lock:
        old = eng.stack
        stack.scheduler.waiting.extend(old.scheduler.release_all())
        stack.scheduler.num_preemptions = old.scheduler.num_preemptions
        install(eng, stack)
        eng._publish_stats()
    return old
