"""The engine's event plumbing: what it emits, installed only while someone listens.

Pool callbacks and per-layer model hooks cost a call each, so they are wired in only
while the bus has subscribers for the events they produce (EventBus.on_change);
with nothing attached the hot path sees `None` checks and nothing else.
"""
from __future__ import annotations


from .attention import native
from ..events import (AttentionRead, EventBus, KVWritten, PagesAllocated, PagesEvicted, PagesFreed,
                      PagesRegistered, PagesShared, now_ns)

# The one map from a pool callback's kind to its event type (the engine and the simulator).
POOL_EVENTS = {"allocated": PagesAllocated, "freed": PagesFreed, "shared": PagesShared,
               "evicted": PagesEvicted, "registered": PagesRegistered}


class ModelHooks:
    """Per-layer callbacks the model calls; each emits an event or feeds a tap."""

    def __init__(self, engine):
        self.engine = engine
        self.bus: EventBus = engine.bus
        self.kv_bytes_per_page_layer = engine.kv.bytes_per_page // max(1, engine.model_config.num_layers)
        self.taps: list = []            # objects with on_kv / on_hidden / on_scores (fp16 probe)

    def on_kv(self, layer, k, v, batch, q=None) -> None:
        bus = self.bus
        if bus.wants(KVWritten):
            bus.emit(KVWritten(self.engine.step_count, now_ns(), layer, native.absmax(k), native.absmax(v),
                               int(k.shape[0])))
        for t in self.taps:
            if q is not None and hasattr(t, "on_q"):     # the fp16 probe's score bound reads q
                t.on_q(layer, q)
            t.on_kv(layer, k, v, batch)

    def on_attention(self, layer, batch, bt_read, o=None) -> None:
        """After layer's attention: o [T, Hq, D] is what the paged path produced."""
        for t in self.taps:
            fn = getattr(t, "on_attention_out", None)
            if fn is not None and o is not None:
                fn(layer, o, batch)
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


def pool_event(kind: str, pages, pool, step: int, t_ns: int, **detail):
    """The event for one pool callback (shared by the engine and the simulator)."""
    pages, actor = tuple(pages), pool.actor
    if kind == "allocated":
        return PagesAllocated(step, t_ns, pages, tuple(pool.generation[p] for p in pages), actor)
    if kind == "freed":
        return PagesFreed(step, t_ns, pages, actor, detail.get("cached", ()), detail.get("still_shared", ()))
    if kind == "shared":
        return PagesShared(step, t_ns, pages, actor)
    if kind == "registered":
        return PagesRegistered(step, t_ns, pages, detail.get("indices", ()), actor)
    return PagesEvicted(step, t_ns, pages)


def refresh(engine) -> None:
    """Wire or unwire the pool observer and model hooks to match what the bus wants."""
    bus = engine.bus
    if any(bus.wants(t) for t in POOL_EVENTS.values()):
        def observer(kind, pages, _e=engine, **detail):
            if _e.bus.wants(POOL_EVENTS[kind]):
                _e.bus.emit(pool_event(kind, pages, _e.pool, _e.step_count, now_ns(), **detail))
        engine.pool.observer = observer
    else:
        engine.pool.observer = None
    hooks = engine.model_hooks
    if bus.wants(KVWritten) or bus.wants(AttentionRead) or hooks.taps:
        engine.model.hooks = hooks
    else:
        engine.model.hooks = None


def add_tap(engine, tap) -> None:
    """Feed a probe's tap (on_kv / on_hidden) from the model; wires the hooks in."""
    engine.model_hooks.taps.append(tap)
    refresh(engine)


def remove_tap(engine, tap) -> None:
    """Stop feeding a tap; the hooks are unwired when nothing else needs them."""
    hooks = engine.model_hooks
    hooks.taps = [t for t in hooks.taps if t is not tap]
    refresh(engine)
