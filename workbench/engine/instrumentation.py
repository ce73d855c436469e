"""The engine's event plumbing: what it emits, installed only while someone listens.

Pool callbacks and per-layer model hooks cost a call each, so they are wired in only
while the bus has subscribers for the events they produce (EventBus.on_change);
with nothing attached the hot path sees `None` checks and nothing else.
"""
from __future__ import annotations

from ..events import (AttentionRead, EventBus, KVWritten, PagesAllocated, PagesEvicted, PagesFreed,
                      PagesShared, now_ns)

POOL_EVENTS = {"allocated": PagesAllocated, "freed": PagesFreed, "shared": PagesShared,
               "evicted": PagesEvicted}


class ModelHooks:
    """Per-layer callbacks the model calls; each emits an event or feeds a tap."""

    def __init__(self, engine):
        self.engine = engine
        self.bus: EventBus = engine.bus
        self.kv_bytes_per_page_layer = engine.kv.bytes_per_page // max(1, engine.model_config.num_layers)
        self.taps: list = []            # objects with on_kv / on_hidden / on_scores (fp16 probe)

    def on_kv(self, layer, k, v, batch) -> None:
        bus = self.bus
        if bus.wants(KVWritten):
            bus.emit(KVWritten(self.engine.step_count, now_ns(), layer, float(k.abs().max()),
                               float(v.abs().max()), int(k.shape[0])))
        for t in self.taps:
            t.on_kv(layer, k, v, batch)

    def on_attention(self, layer, batch, bt_read) -> None:
        bus = self.bus
        if bus.wants(AttentionRead):
            bt = self.engine.builder.block_tables
            plan = batch.attn_plan
            pages = plan.pages_read if plan is not None else 0
            bus.emit(AttentionRead(self.engine.step_count, now_ns(), layer, bt.version, bt.checksum,
                                   pages * self.kv_bytes_per_page_layer))

    def on_hidden(self, layer, h, batch) -> None:
        for t in self.taps:
            t.on_hidden(layer, h, batch)


def refresh(engine) -> None:
    """Wire or unwire the pool observer and model hooks to match what the bus wants."""
    bus = engine.bus
    if any(bus.wants(t) for t in POOL_EVENTS.values()):
        def observer(kind, pages, _e=engine):
            et = POOL_EVENTS[kind]
            if _e.bus.wants(et):
                if et is PagesAllocated:
                    gens = tuple(_e.pool.generation[p] for p in pages)
                    _e.bus.emit(et(_e.step_count, now_ns(), tuple(pages), gens))
                else:
                    _e.bus.emit(et(_e.step_count, now_ns(), tuple(pages)))
        engine.pool.observer = observer
    else:
        engine.pool.observer = None
    hooks = engine.model_hooks
    if bus.wants(KVWritten) or bus.wants(AttentionRead) or hooks.taps:
        engine.model.hooks = hooks
    else:
        engine.model.hooks = None
