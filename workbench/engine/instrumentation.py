"""The engine's event plumbing: what it emits, installed only while someone listens.

Pool callbacks and per-layer model hooks cost a call each, so they are wired in only
while the bus has subscribers for the events they produce (EventBus.on_change);
with nothing attached the hot path sees `None` checks and nothing else.
"""
from __future__ import annotations

from itertools import chain, repeat

import torch

from .attention import native
from .pages import POOL_EVENTS
from .taps import NEEDS, ModelTap, scopes_layers, validate  # NEEDS, ModelTap: also reachable from here, with add_tap
from ..events import AttentionRead, EventBus, KVWritten, now_ns


# A forward of at most this many rows (decode) has its per-layer events emitted after its last layer,
# 2L rows in one go, instead of two emissions between each layer's kernels, where every small op
# runs cold. Their K / V absmax come from the fused store's measurement (kv_absmax_buffer: one
# reduction of [L, 2, T] at the end); where a layer was not measured so (no fused store: bf16 rows,
# an fp16 cache, the torch path), its K / V are kept until then and reduced in one call: views, so
# each keeps its layer's whole q|k|v buffer alive (64 rows x (Hq + 2 Hkv) x D floats a layer: ~7 MB
# for SmolLM2's 30 layers, ~50 MB for an 8B model). A bigger forward (prefill) is deferred too where the
# store measures it (nothing to keep alive), else it emits at each layer.
# So a decode's rows reach the bus after anything else its forward emitted (a probe's finding at a
# layer, the fp16 probe's judgement at the last one); each row's t_ns is still when its layer ran.
DEFER_ROWS = 64

# What a fused store measures of each row it writes (ModelHooks.kv_absmax_buffer), in this order:
# max |K| and |V| (KVWritten, the fp16 probe), and the largest per-head L2 norm of K and of q (the
# fp16 probe's score bound). NaN-propagating; K and q rotated (the norms RoPE keeps).
ROW_STATS = ("k_absmax", "v_absmax", "k_head_norm", "q_head_norm")


class ModelHooks:
    """Per-layer callbacks the model calls; each emits an event or feeds the taps that declared the
    need (taps.py). The per-need lists of bound methods are rebuilt when a tap is added or removed,
    so a layer's call only walks the taps that asked for it."""

    def __init__(self, engine):
        self.engine = engine
        self.bus: EventBus = engine.bus
        self.num_layers = engine.model_config.num_layers
        self.kv_bytes_per_page_layer = engine.kv.bytes_per_page // max(1, self.num_layers)
        self._deferred: list | None = None       # this forward's (type, row) per layer, when deferred
        self._kvbuf = None                        # [L, 4, T]: each row's ROW_STATS, by the fused store
        self._measured: list | None = None        # per layer: whether _kvbuf holds it
        self._memo = None                         # (layer, k, v, [2, T]) of a layer measured here
        self._step, self._want_kv, self._want_read, self._bt, self._read_bytes = 0, False, False, None, 0
        self._bt_read = (0, 0)
        self._loud = [False] * self.num_layers    # a forward whose per-layer rows go out at each layer
        self.quiet = self._loud                   # per layer of this forward: the model only stamps times
        self.kv_t = self.read_t = [0] * self.num_layers     # there, when its K / V was stored and read
        self.set_taps([])

    @property
    def taps(self) -> list:
        return [t for t, _ in self._declared]

    def set_taps(self, declared: list) -> None:
        """Install these taps, (tap, its validated needs) each: per need, one list of bound methods
        per layer. The needs are the ones add_tap froze, whatever the tap's attribute says later."""
        self._declared = list(declared)
        self._scoped = [(i, t.forward_layers) for i, (t, _) in enumerate(self._declared) if scopes_layers(t)]
        self._absmax_needs = [("kv_absmax" in n or "row_stats" in n) for _, n in self._declared]
        # taps whose on_q / on_kv stand in for the store's figures: not called where the store measured (a tap
        # that also declares "kv" reads K / V themselves: called at every layer of its scope)
        self._stats_only = [("row_stats" in n and "kv" not in n and "kv_absmax" not in n) for _, n in self._declared]
        # taps whose on_hidden stands in for the norms' measurement: called at the last layer only where measured
        self._hidden_only = [("hidden_absmax" in n) for _, n in self._declared]
        self._every_row = [t.reads_every_row for t, n in self._declared if "every_row_hidden" in n]
        self._active = None
        self._built: dict[tuple, tuple] = {}      # active layers -> call lists: a tap that rotates its layer
        self._build([True] * len(self._declared))  # (the attention probe) meets each answer again
        self._hbuf, self._hidden_now = None, self._hidden      # begin_forward sets them per forward

    def _build(self, active: list) -> None:
        """The per-layer call lists for taps active at these layers (True: every layer)."""
        self._active = active
        key = tuple(active)
        got = self._built.get(key)
        if got is not None:
            (self._q, self._kv, self._q_m, self._kv_m, self._out, self._hidden, self._hidden_m, self._no_taps,
             self._absmax_active, self._hidden_active) = got
            return
        L = self.num_layers

        def per_layer(needs: set, method: str, skip: list | None = None) -> list:
            # skip: per declared tap, whether to leave it out (the lists for a layer the fused store or the
            # norms measured: the "row_stats" / "hidden_absmax" taps are not called there)
            fns = [(getattr(t, method), a) for (t, n), a, left in zip(self._declared, active, skip or repeat(False))
                   if n & needs and not left]
            every = [f for f, a in fns if a is True]
            lists = [every] * L                  # one list for the layers no scoped tap reads
            for l in frozenset().union(*(a for _, a in fns if a is not True)):    # only the layers one does
                if 0 <= l < L:                   # (the attention probe's two a forward: ~100 us for all L before)
                    lists[l] = [f for f, a in fns if a is True or l in a]
            return lists

        self._q = per_layer({"q"}, "on_q")
        self._kv = per_layer({"kv", "kv_absmax", "row_stats"}, "on_kv")
        self._q_m = per_layer({"q"}, "on_q", self._stats_only)
        self._kv_m = per_layer({"kv", "kv_absmax", "row_stats"}, "on_kv", self._stats_only)
        self._out = per_layer({"attention_out"}, "on_attention_out")
        self._hidden = per_layer({"hidden", "every_row_hidden", "hidden_absmax"}, "on_hidden")
        # where the norms measure: a "hidden_absmax" tap at the last layer only (no later norm measures it)
        self._hidden_m = per_layer({"hidden", "every_row_hidden", "hidden_absmax"}, "on_hidden", self._hidden_only)
        self._hidden_m[L - 1] = self._hidden[L - 1]
        # per layer: no tap is called at its K / V or its attention output where the store measured it (a
        # quiet layer when deferring; a quiet layer the store did not measure still calls on_kv)
        self._no_taps = [not (self._q_m[l] or self._kv_m[l] or self._out[l]) for l in range(L)]
        # a tap reading the row figures is called somewhere in this forward (the fp16 probe measuring)
        # (each tap's entry: True, every layer, or the frozenset of its layers: truthy when it reads one)
        self._absmax_active = any(need and bool(a) for need, a in zip(self._absmax_needs, active))
        self._hidden_active = any(need and bool(a) for need, a in zip(self._hidden_only, active))
        if len(self._built) < 4096:
            self._built[key] = (self._q, self._kv, self._q_m, self._kv_m, self._out, self._hidden, self._hidden_m,
                                self._no_taps, self._absmax_active, self._hidden_active)

    def begin_forward(self, batch) -> None:
        """Before layer 0: ask the taps that scope themselves which layers they read in this
        forward; the call lists are rebuilt only when the answer changed."""
        self._deferred = [] if batch.input_ids.shape[0] <= DEFER_ROWS else None
        self._big = False                                        # a bigger forward deferred (kv_absmax_buffer)
        self._kvbuf = self._measured = self._memo = None       # kv_absmax_buffer() sets them for a fused store
        # What every layer of this forward shares, looked up once (the per-layer calls run between
        # the layers' kernels, where each Python line pays for cold caches): the step, what the bus
        # wants per layer, the table object the kernels read and the bytes a layer's attention reads.
        bus = self.bus
        self._step = self.engine.step_count
        self._want_kv, self._want_read = bus.wants(KVWritten), bus.wants(AttentionRead)
        plan = batch.attn_plan
        self._bt = self.engine.builder.block_tables
        self._read_bytes = (plan.pages_read if plan is not None else 0) * self.kv_bytes_per_page_layer
        self._bt_read = (self._bt.version, self._bt.checksum)
        if self._scoped:
            active = [True] * len(self._declared)
            for i, ask in self._scoped:
                got = ask(batch)
                if got is not True:
                    got = frozenset(got) if isinstance(got, (set, frozenset, list, tuple, range)) else frozenset()
                active[i] = got
            if active != self._active:
                self._build(active)
        self._hbuf, self._hidden_now = None, self._hidden       # (after the build) hidden_absmax_buffer() may switch
        # Quiet layers: no tap is called there, and their per-layer rows (if wanted) wait for
        # end_forward. The model then only stamps the time there (kv_t / read_t: a list store, no
        # Python call: a call between the layers' kernels cost ~8-15 us, cold) and calls on_kv
        # only where the store did not measure the layer's K / V itself.
        L = self.num_layers
        self.quiet = self._no_taps if self._deferred is not None or not (self._want_kv or self._want_read) \
            else self._loud
        self.kv_t, self.read_t = [0] * L, [0] * L

    # ---- each row's ROW_STATS: measured by the fused store where it runs, else here ----------------
    def kv_absmax_buffer(self, t: int, num_layers: int):
        """Before layer 0 (the model asks, where its store is fused): [L, 4, t] for the store to fill
        with each row's ROW_STATS, when someone reads them (the event log's KVWritten, a tap
        declaring "kv_absmax" or "row_stats"); else None."""
        self._memo = None
        if not (self._absmax_active or self._want_kv):
            self._kvbuf = self._measured = None
            return None
        # the head norms only for a tap that reads them; float32 on the CPU whatever torch's defaults
        rows = len(ROW_STATS) if self._absmax_active else 2
        self._kvbuf = torch.empty(num_layers, rows, t, dtype=torch.float32, device="cpu")
        self._measured = [False] * num_layers
        if self._deferred is None:          # a bigger forward: deferred too, its figures are in the buffer
            self._deferred, self._big = [], True          # (a layer the store does not measure: reduced at once)
            self.quiet = self._no_taps
        return self._kvbuf

    def hidden_absmax_buffer(self, t: int, num_layers: int):
        """Before layer 0 (the model asks, where its norms are compiled): [L, t] for each layer's norm to fill
        with the max |h| of the rows it reads (layer l + 1's norm measures layer l's hidden state; the last
        layer's row stays unfilled), when a "hidden_absmax" tap reads this forward; else None."""
        if not self._hidden_active:
            return None
        self._hbuf = torch.empty(num_layers, t, dtype=torch.float32, device="cpu")
        self._hidden_now = self._hidden_m
        return self._hbuf

    def hidden_buffer(self):
        """[L, T]: this forward's hidden-state row absmax as the norms measured them (every layer but the
        last, whose on_hidden the "hidden_absmax" taps get), or None where the norms measure none."""
        return self._hbuf

    def kv_absmax(self, layer, k, v) -> torch.Tensor:
        """[2, T]: each row's max |K| and |V| at this layer (NaN-propagating): what the fused store
        measured, else one rows_absmax pass over k and v (kept for the layer's other readers)."""
        if self._measured is not None and self._measured[layer]:
            return self._kvbuf[layer, :2]
        memo = self._memo
        if memo is not None and memo[0] == layer and memo[1] is k and memo[2] is v:
            return memo[3]
        got = native.rows_absmax([k, v]) if k.shape[0] else torch.zeros(2, 0)
        self._memo = (layer, k, v, got)
        return got

    def row_stats(self, layer):
        """[4, T]: each row's ROW_STATS at this layer as the fused store measured them, else None."""
        ok = self._measured is not None and self._measured[layer] and self._kvbuf.shape[1] == len(ROW_STATS)
        return self._kvbuf[layer] if ok else None

    @property
    def store_measured(self) -> bool:
        """Whether the fused store measured every layer of this (or the last) forward."""
        m = self._measured
        return m is not None and all(m)

    def measured_layers(self) -> list[bool] | None:
        """Per layer of this forward so far, whether the fused store measured it (a quiet layer's stamp, or
        on_kv told so); None where no buffer was made. What a "row_stats" tap may read from stats_buffer()."""
        m = self._measured
        if m is None:
            return None
        return [bool(done or t) for done, t in zip(m, self.kv_t)]

    def stats_buffer(self):
        """[L, 4, T]: this forward's buffer the fused store fills with every ROW_STATS (a layer it measured
        did not call the "row_stats" taps' on_kv), or None where it fills none (or only max |K|, |V|)."""
        buf = self._kvbuf
        return buf if buf is not None and buf.shape[1] == len(ROW_STATS) else None

    def forward_row_stats(self):
        """[L, 4, T] (ROW_STATS per layer and row) when the fused store measured every layer of this
        forward, else None."""
        return self._kvbuf if self.store_measured and self._kvbuf.shape[1] == len(ROW_STATS) else None

    def on_kv(self, layer, k, v, batch, q=None, measured: bool = False) -> None:
        """measured: the fused store filled kv_absmax_buffer's row for this layer."""
        if measured and self._measured is not None:
            self._measured[layer] = True
        if self._want_kv:
            deferred = self._deferred
            if deferred is not None:                # emitted after the last layer (end_forward)
                n = k.shape[0]
                if measured:                        # nothing to keep alive
                    deferred.append((KVWritten, (self._step, now_ns(), layer, None, None, n)))
                elif self._big:                     # too big to keep alive: its figures now
                    k_max, v_max = _row_max(self.kv_absmax(layer, k, v)) if n else (0.0, 0.0)
                    deferred.append((KVWritten, (self._step, now_ns(), layer, k_max, v_max, n)))
                else:                               # reduced with the others at the end
                    deferred.append((KVWritten, (self._step, now_ns(), layer, k, v, n)))
            else:           # K and V in one pass (rows_absmax) or the store's; the event object only for who takes objects
                k_max, v_max = _row_max(self.kv_absmax(layer, k, v)) if k.shape[0] else (0.0, 0.0)
                self.bus.emit_row(KVWritten, (self._step, now_ns(), layer, k_max, v_max, int(k.shape[0])))
        # where the store measured every ROW_STATS, the taps reading them ("row_stats") are not called
        stats = measured and self.stats_buffer() is not None
        if q is not None:
            for fn in (self._q_m if stats else self._q)[layer]:     # the fp16 probe's score bound, the shadow's q check
                fn(layer, q)
        for fn in (self._kv_m if stats else self._kv)[layer]:
            fn(layer, k, v, batch)

    def on_attention(self, layer, batch, bt_read, o=None) -> None:
        """After layer's attention: o [T, Hq, D] is what the paged path produced."""
        if o is not None:
            for fn in self._out[layer]:
                fn(layer, o, batch)
        if self._want_read:                         # the version / checksum the table holds as this layer read it
            bt = self._bt
            row = (self._step, now_ns(), layer, bt.version, bt.checksum, self._read_bytes)
            if self._deferred is not None:
                self._deferred.append((AttentionRead, row))
            else:
                self.bus.emit_row(AttentionRead, row)

    def end_forward(self, batch) -> None:
        """After the last layer: the deferred per-layer events, in layer order, each stamped when its
        layer ran; every layer's K and V absmax from one reduction each."""
        held, self._deferred = self._deferred, None
        self._memo = None
        if held is None:
            return
        kv_t = self.kv_t
        if self._measured is not None:      # a stamped quiet layer's K / V: the store measured them
            self._measured = self.measured_layers()
        want_kv, want_read = self._want_kv, self._want_read
        if not (want_kv or want_read):
            return                          # (nothing is held then: on_kv / on_attention add rows only when wanted)
        # each layer's max |K|, |V| as the store measured them (None: not measured; read only where used)
        stored = self._layer_maxima() if want_kv and self._kvbuf is not None and self._kvbuf.shape[2] else None
        if held:
            held = self._resolved(held, stored)
        quiet = self.quiet
        if not any(quiet):
            items = held
        elif want_kv and want_read and all(kv_t[l] and self.read_t[l] for l, q in enumerate(quiet) if q):
            items = self._layer_rows(held, stored)
        else:
            items = self._with_quiet_rows(held, stored)
        if items:
            self.bus.emit_rows(items)

    def _layer_maxima(self) -> list:
        """[(max |K|, max |V|)] per layer over this forward's rows, from the store's [L, S, T] buffer: one
        compiled reduction over its L x S rows where the kernel is loaded (a numpy reduction here, cold
        after the last layer, cost ~80 us a decode), numpy otherwise. NaN-propagating."""
        buf = self._kvbuf
        L, S, T = buf.shape
        k = native.kernel()
        if k is not None and buf.is_contiguous():
            m = k.row_absmax(buf.view(L * S, T)).tolist()      # every figure is >= 0 (or NaN): absmax = max
            return list(zip(m[0::S], m[1::S]))
        return [tuple(r) for r in buf.numpy()[:, :2].max(2).tolist()]

    def _resolved(self, held: list, stored) -> list:
        """held with each KVWritten row's K / V figures in place: the store's (None), reduced now (tensors,
        in one call each for K and V), or as given."""
        rest = [row for t, row in held if t is KVWritten and isinstance(row[3], torch.Tensor)]
        k_max = dict(zip((r[2] for r in rest), native.absmax_each([r[3] for r in rest]))) if rest else {}
        v_max = dict(zip((r[2] for r in rest), native.absmax_each([r[4] for r in rest]))) if rest else {}
        out = []
        for t, row in held:
            if t is KVWritten:
                s, ts, layer, k, v, n = row
                if k is None:
                    k, v = stored[layer] if stored is not None and n else (0.0, 0.0)
                elif isinstance(k, torch.Tensor):
                    k, v = k_max[layer], v_max[layer]
                row = (s, ts, layer, k, v, n)
            out.append((t, row))
        return out

    def _layer_rows(self, held: list, stored) -> list:
        """Every layer's KVWritten and AttentionRead rows, in layer order, built in one pass for a forward
        whose quiet layers all ran (each stamped its K / V store and its read): the quiet layers' rows
        from the stamps, the store's maxima and the table bound when the forward began; a layer that
        called the hooks keeps the rows it gave (none: it did not run)."""
        L, step, n = self.num_layers, self._step, self._kvbuf.shape[2] if self._kvbuf is not None else 0
        version, checksum = self._bt_read
        ks, vs = zip(*stored) if stored is not None else (repeat(0.0), repeat(0.0))
        kv = zip(repeat(KVWritten), zip(repeat(step), self.kv_t, range(L), ks, vs, repeat(n)))
        ar = zip(repeat(AttentionRead), zip(repeat(step), self.read_t, range(L), repeat(version), repeat(checksum),
                                            repeat(self._read_bytes)))
        items = list(chain.from_iterable(zip(kv, ar)))        # layer l's rows at 2l, 2l + 1
        by_layer: dict = {}
        for item in held:
            by_layer.setdefault(item[1][2], []).append(item)
        for layer, q in reversed(list(enumerate(self.quiet))):   # from the top: the indices below stay put
            if not q:
                items[2 * layer:2 * layer + 2] = by_layer.get(layer, [])
        return items

    def _with_quiet_rows(self, held: list, stored) -> list:
        """held (the rows of the layers that called on_kv / on_attention, figures resolved) with the quiet
        layers' rows, all in layer order, KVWritten before AttentionRead at each layer. A quiet layer's
        K / V absmax come from the store's buffer; its table version and checksum are the ones
        bound when the forward began (nothing rebinds it mid-forward). A layer that did not run
        (a forward that raised) has no stamp and no row."""
        by_layer: dict = {}
        for t, row in held:
            by_layer.setdefault(row[2], []).append((t, row))
        step, n, quiet = self._step, (self._kvbuf.shape[2] if self._kvbuf is not None else 0), self.quiet
        version, checksum = self._bt_read
        out = []
        for layer in range(self.num_layers):
            rows = by_layer.get(layer)
            if rows is not None and not quiet[layer]:
                out += rows
                continue
            rows = rows or []                       # a quiet layer unmeasured by the store called on_kv
            if self._want_kv and self.kv_t[layer]:
                k, v = stored[layer] if stored is not None and n else (0.0, 0.0)
                rows.append((KVWritten, (step, self.kv_t[layer], layer, k, v, n)))
            if self._want_read and self.read_t[layer]:
                rows.append((AttentionRead, (step, self.read_t[layer], layer, version, checksum, self._read_bytes)))
            out += rows
        return out

    def forward_failed(self, batch) -> None:
        """A forward that raised: the rows its layers measured go out (a failed step's flight record
        keeps the per-layer K / V absmax, often where a NaN or an overflow shows), then nothing is held."""
        try:
            self.end_forward(batch)
        except Exception:               # noqa: BLE001 - the forward's own error is the one to raise
            self._deferred = None

    @property
    def reads_hidden(self) -> bool:
        """Whether a tap reads every row's hidden state after the last layer of this forward (it
        declared "every_row_hidden" and its reads_every_row() says so now): the model then runs the
        last layer for every row, not only for the sampled ones. Asked when the last layer begins."""
        return any(fn() for fn in self._every_row)

    @property
    def hidden_calls(self) -> list:
        """Per layer, the taps that read its hidden state (in this forward's scope): the model calls
        on_hidden only where one does (the event log alone reads none)."""
        return self._hidden_now

    def on_hidden(self, layer, h, batch) -> None:
        """h: every row's hidden state after `layer`; after the last layer only the sampled rows'
        (batch.logits_indices) unless reads_hidden."""
        for fn in self._hidden_now[layer]:
            fn(layer, h, batch)


def _row_max(t: torch.Tensor) -> list[float]:
    """Each row's max (NaN-propagating) as floats: numpy's on a CPU tensor (one cold torch op between a
    prefill's layers cost ~50-100 us), torch's elsewhere."""
    if t.device.type != "cpu":
        return t.amax(1).tolist()
    return (t if t.dtype == torch.float32 else t.float()).numpy().max(1).tolist()     # bf16 rows: numpy has no bf16


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
