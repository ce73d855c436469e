"""ModelTap: the one interface a probe implements to read the forward's tensors (instrumentation.add_tap).

A tap declares what it reads in `needs`, from NEEDS, and implements exactly the methods those
needs name (METHODS); the base methods raise, so a tap that forgets one fails at add_tap, not
silently mid-run. The hooks call a tap only for what it declared, from lists built at add_tap:
the per-layer path looks nothing up.

- "q":            on_q(layer, q)                 q [T, Hq, D] after RoPE, before attention
- "kv":           on_kv(layer, k, v, batch)      k, v [T, Hkv, D] as handed to the cache write
- "attention_out": on_attention_out(layer, o, batch)  o [T, Hq, D], the paged attention's output
- "hidden":       on_hidden(layer, h, batch)     the residual stream after each layer; after the
                  last layer only the sampled rows' (the model prunes the others: model.py)
- "kv_absmax":    "kv", and each row's max |K| and |V| ready for the tap at each layer:
                  ModelHooks.kv_absmax(layer, k, v) -> [2, T] (a fused store measures them in the same
                  pass, where it runs: no read of K and V of its own); and where the store measured
                  them, row_stats(layer) -> [4, T] / forward_row_stats() -> [L, 4, T]: also each row's
                  largest per-head L2 norm of K and of q (instrumentation.ROW_STATS), else None
- "row_stats":    each row's ROW_STATS as the fused store measures them, read once the layers ran
                  (ModelHooks.stats_buffer() -> [L, 4, T]); on_kv (and on_q, with "q") only at the
                  layers the store did not measure, to take their figures from K, V and q instead. A
                  layer where no other tap reads K / V stays quiet (a time stamp, no Python call): the
                  fp16 probe's measured decode forwards called ~4 methods a layer before.
- "hidden_absmax": each row's max |h| of each layer's hidden state as the next layer's compiled norm
                  measures it while reading it (ModelHooks.hidden_buffer() -> [L, T], every layer but the
                  last); on_hidden(layer, h, batch) at the last layer, and at every layer of a forward
                  whose norms do not measure (the torch path, another device). With "every_row_hidden"
                  the last layer still keeps every row on the forwards reads_every_row() asks it to.
- "every_row_hidden": "hidden", and the last layer runs for every row so on_hidden sees all T rows
                  (costs ~3% of a prefill step's linears). A tap that wants that only on some
                  forwards also overrides reads_every_row() (asked once per forward, at the last
                  layer: the fp16 probe on its measured steps).

A tap that reads only some layers of a forward (one layer a step, or every layer one step in four)
also overrides forward_layers(batch): asked once per forward, before layer 0, it returns the layers
to call the tap at in this forward (a collection of indices, possibly empty), or True for every
layer. The hooks then do not call the tap at the others: an idle layer costs the tap nothing, not
a Python call per need. A tap that does not override it is called at every layer.

`needs` is read once, at add_tap: a class attribute, or set per instance in __init__ (a tap
whose optional callback decides what it reads); to change it, remove the tap and add it again.
"""
from __future__ import annotations

# need -> the method it calls ("every_row_hidden" is "hidden" that also keeps every row)
METHODS = {"q": "on_q", "kv": "on_kv", "kv_absmax": "on_kv", "row_stats": "on_kv", "hidden_absmax": "on_hidden",
           "attention_out": "on_attention_out",
           "hidden": "on_hidden", "every_row_hidden": "on_hidden"}
NEEDS = frozenset(METHODS)


class ModelTap:
    needs: frozenset = frozenset()

    def on_q(self, layer, q) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_q: declare 'q' in needs and implement it")

    def on_kv(self, layer, k, v, batch) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_kv: declare 'kv' in needs and implement it")

    def on_attention_out(self, layer, o, batch) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_attention_out: declare 'attention_out' in needs "
                                  f"and implement it")

    def on_hidden(self, layer, h, batch) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_hidden: declare 'hidden' in needs and implement it")

    def forward_layers(self, batch):
        """The layers this forward calls the tap at: True (every layer), or a collection of layer
        indices (empty: none). Asked once per forward, before layer 0; a result that is neither is
        taken as none (a guarded probe that failed returns None)."""
        return True

    def reads_every_row(self) -> bool:
        """For a tap declaring "every_row_hidden": whether this forward must keep every row."""
        return True


def _overridden(tap: ModelTap, name: str) -> bool:
    """The tap's own method (in a subclass or set on the instance: a probe's guarded callable)."""
    fn = getattr(tap, name)
    return getattr(fn, "__func__", fn) is not getattr(ModelTap, name)


def validate(tap) -> frozenset:
    """The tap's needs, checked: a ModelTap, a non-empty subset of NEEDS, each need's method its own."""
    if not isinstance(tap, ModelTap):
        raise TypeError(f"{type(tap).__name__} is not a ModelTap (workbench.engine.taps): subclass it and "
                        f"declare `needs`")
    needs = tap.needs
    if isinstance(needs, str) or not all(isinstance(n, str) for n in needs):
        raise ValueError(f"{type(tap).__name__}.needs must be a set of names from {sorted(NEEDS)}, got {needs!r}")
    needs = frozenset(needs)
    if not needs:
        raise ValueError(f"{type(tap).__name__}.needs is empty: declare what it reads, from {sorted(NEEDS)}")
    unknown = sorted(needs - NEEDS)
    if unknown:
        raise ValueError(f"{type(tap).__name__}.needs: unknown need(s) {unknown}; known: {sorted(NEEDS)}")
    for n in sorted(needs):
        if not _overridden(tap, METHODS[n]):
            raise TypeError(f"{type(tap).__name__} declares {n!r} but does not implement {METHODS[n]}()")
    if "every_row_hidden" not in needs and _overridden(tap, "reads_every_row"):
        raise TypeError(f"{type(tap).__name__} overrides reads_every_row() but does not declare 'every_row_hidden'"
                        f" (it would never be asked)")
    return needs


def scopes_layers(tap) -> bool:
    """Whether the tap overrides forward_layers (the hooks ask it each forward)."""
    return _overridden(tap, "forward_layers")
