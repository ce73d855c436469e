"""The engine's event plumbing: what it emits, installed only while someone listens.

Pool callbacks and per-layer model hooks cost a call each, so they are wired in only
while the bus has subscribers for the events they produce (EventBus.on_change);
with nothing attached the hot path sees `None` checks and nothing else.
"""
from __future__ import annotations


from .attention import native
from .pages import POOL_EVENTS
from .taps import NEEDS, ModelTap, validate  # NEEDS, ModelTap: also reachable from here, with add_tap
from ..events import AttentionRead, EventBus, KVWritten, now_ns


class ModelHooks:
    """Per-layer callbacks the model calls; each emits an event or feeds the taps that declared the
    need (taps.py). The per-need lists of bound methods are rebuilt when a tap is added or removed,
    so a layer's call only walks the taps that asked for it."""

    def __init__(self, engine):
        self.engine = engine
        self.bus: EventBus = engine.bus
        self.kv_bytes_per_page_layer = engine.kv.bytes_per_page // max(1, engine.model_config.num_layers)
        self.set_taps([])

    @property
    def taps(self) -> list:
        return [t for t, _ in self._declared]

    def set_taps(self, declared: list) -> None:
        """Install these taps, (tap, its validated needs) each: one list of bound methods per need.
        The needs are the ones add_tap froze, whatever the tap's attribute says later."""
        self._declared = needs = list(declared)
        self._q = [t.on_q for t, n in needs if "q" in n]
        self._kv = [t.on_kv for t, n in needs if "kv" in n]
        self._out = [t.on_attention_out for t, n in needs if "attention_out" in n]
        self._hidden = [t.on_hidden for t, n in needs if "hidden" in n or "every_row_hidden" in n]
        self._every_row = [t.reads_every_row for t, n in needs if "every_row_hidden" in n]

    def on_kv(self, layer, k, v, batch, q=None) -> None:
        bus = self.bus
        if bus.wants(KVWritten):
            bus.emit(KVWritten(self.engine.step_count, now_ns(), layer, native.absmax(k), native.absmax(v),
                               int(k.shape[0])))
        if q is not None:
            for fn in self._q:                        # the fp16 probe's score bound, the shadow's q check
                fn(layer, q)
        for fn in self._kv:
            fn(layer, k, v, batch)

    def on_attention(self, layer, batch, bt_read, o=None) -> None:
        """After layer's attention: o [T, Hq, D] is what the paged path produced."""
        if o is not None:
            for fn in self._out:
                fn(layer, o, batch)
        bus = self.bus
        if bus.wants(AttentionRead):
            bt = self.engine.builder.block_tables
            plan = batch.attn_plan
            pages = plan.pages_read if plan is not None else 0
            bus.emit(AttentionRead(self.engine.step_count, now_ns(), layer, bt.version, bt.checksum,
                                   pages * self.kv_bytes_per_page_layer))

    @property
    def reads_hidden(self) -> bool:
        """Whether a tap reads every row's hidden state after the last layer of this forward (it
        declared "every_row_hidden" and its reads_every_row() says so now): the model then runs the
        last layer for every row, not only for the sampled ones. Asked when the last layer begins."""
        return any(fn() for fn in self._every_row)

    def on_hidden(self, layer, h, batch) -> None:
        """h: every row's hidden state after `layer`; after the last layer only the sampled rows'
        (batch.logits_indices) unless reads_hidden."""
        for fn in self._hidden:
            fn(layer, h, batch)


def pool_observer(bus: EventBus, clock):
    """The pool's observer for a listener: each change the pool reports as (event type, fields)
    becomes that event, stamped with clock() -> (step, t_ns), if the bus wants it. Shared by
    the engine and the simulator; PagePool names the types (pages.POOL_EVENTS)."""
    def observer(etype, *fields):
        if bus.wants(etype):
            bus.emit_row(etype, (*clock(), *fields))     # the event is built only for those who take objects
    return observer


def wants_pool_events(bus: EventBus) -> bool:
    return any(bus.wants(t) for t in POOL_EVENTS)


def refresh(engine) -> None:
    """Wire or unwire the pool observer and model hooks to match what the bus wants."""
    bus = engine.bus
    if wants_pool_events(bus):
        engine.pool.observer = pool_observer(bus, lambda _e=engine: (_e.step_count, now_ns()))
    else:
        engine.pool.observer = None
    hooks = engine.model_hooks
    if bus.wants(KVWritten) or bus.wants(AttentionRead) or hooks.taps:
        engine.model.hooks = hooks
    else:
        engine.model.hooks = None


def add_tap(engine, tap: ModelTap) -> None:
    """Feed a probe's tap (a ModelTap: what its `needs` declare) from the model; wires the hooks in.
    A tap that fails validation (taps.validate) raises before anything changes."""
    needs = validate(tap)
    hooks = engine.model_hooks
    hooks.set_taps(hooks._declared + [(tap, needs)])
    refresh(engine)


def remove_tap(engine, tap) -> None:
    """Stop feeding a tap; the hooks are unwired when nothing else needs them."""
    hooks = engine.model_hooks
    hooks.set_taps([(t, n) for t, n in hooks._declared if t is not tap])
    refresh(engine)
