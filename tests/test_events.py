"""Event plumbing: typed events reach subscribers, cost nothing unsubscribed, land in the log."""
import pytest

from workbench import Engine, EngineConfig, Probe, SamplingParams, Workbench
from workbench.event_log import EventLog
from workbench.events import BatchPacked, EventBus, PagesAllocated, RequestFinished, StepFinished


@pytest.fixture()
def engine(tiny_llama_dir):
    return Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))


def test_nothing_wired_when_nobody_listens(engine):
    assert engine.pool.observer is None and engine.model.hooks is None
    log = EventLog(engine.bus)
    assert engine.pool.observer is not None and engine.model.hooks is not None
    log.detach()
    assert engine.pool.observer is None and engine.model.hooks is None


def test_event_log_records_a_run(engine):
    log = EventLog(engine.bus)
    outs = engine.generate([[5, 6, 7] * 10, [9] * 40], SamplingParams(max_tokens=5, ignore_eos=True))
    df = log.frame()
    counts = df["event"].value_counts()
    for name in ("RequestArrived", "RequestAdmitted", "PagesAllocated", "BlockTableBound", "BatchPacked",
                 "AttentionRead", "KVWritten", "StepFinished", "RequestFinished", "PagesFreed"):
        assert counts.get(name, 0) > 0, name
    fin = log.frame(RequestFinished)
    assert sorted(fin["request_id"]) == sorted(o.request_id for o in outs)
    assert (fin["output_len"] == 5).all()
    steps = log.frame(StepFinished)
    assert steps["num_tokens"].iloc[0] == 70 and (steps["duration_ns"] > 0).all()
    alloc = log.frame(PagesAllocated)
    assert sum(len(p) for p in alloc["pages"]) >= 2 + 3          # ceil(30/16) + ceil(40/16)
    assert df["seq"].is_monotonic_increasing


def test_event_log_spills_to_parquet(engine, tmp_path):
    log = EventLog(engine.bus, types=[BatchPacked], max_rows=4, spill_dir=str(tmp_path))
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert list(tmp_path.glob("BatchPacked-*.parquet"))
    assert len(log.frame(BatchPacked)) == 12 and log.dropped == 0


def test_bus_error_handler_and_unsubscribe():
    bus = EventBus()
    seen, errors = [], []
    bus.on_error = lambda fn, ev, e: errors.append(e)
    bad = lambda e: 1 / 0
    bus.subscribe(PagesAllocated, seen.append)
    bus.subscribe(PagesAllocated, bad)
    bus.emit(PagesAllocated(0, 0, (1,), (1,)))
    assert len(seen) == 1 and isinstance(errors[0], ZeroDivisionError)
    bus.unsubscribe(seen.append)
    bus.unsubscribe(bad)
    assert not bus.wants(PagesAllocated)


class Exploding(Probe):
    name = "exploding"

    def on_attach(self, engine):
        self.listen(StepFinished, self.boom)

    def boom(self, e):
        raise RuntimeError("probe bug")


def test_a_raising_probe_becomes_a_finding_and_the_engine_carries_on(engine):
    wb = Workbench(engine)
    p = Exploding().attach(engine)
    wb.probes["exploding"] = p
    outs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(outs[0].token_ids) == 6
    df = wb.findings
    assert list(df["kind"]) == ["probe-error"]          # deduplicated: one finding, not one per step
    assert "probe bug" in df["message"].iloc[0] and df["severity"].iloc[0] == "error"


def test_the_event_log_module_imports_on_its_own():
    """event_log.py sits above events.py (the log keeps the events; events know no log): either module
    imports first, alone, and events.py never reaches for the log."""
    import subprocess
    import sys
    for first in ("import workbench.event_log", "import workbench.events"):
        code = first + "; import sys; from workbench.event_log import EventLog; import workbench.events as ev; " \
                       "assert not hasattr(ev, 'EventLog')"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("fused", [True, False, "patched"])
def test_per_layer_events_carry_each_layers_absmax_in_layer_order_deferred_or_not(engine, fused, monkeypatch):
    # a forward of <= DEFER_ROWS rows emits its KVWritten / AttentionRead rows after its last layer;
    # a bigger one too where the store measured it, else at each layer. Either way each row is its layer's, measured on the K / V the
    # layer handed to the store, stamped when it ran: by the fused store as it wrote them (fused),
    # or by the hooks' own reduction (the store unfused through its seam, or patched the way a user's
    # wrapper that drops its return value is: the store then measured nothing the hooks can trust).
    import torch

    from workbench.engine import instrumentation
    from workbench.engine.taps import ModelTap
    from workbench.events import AttentionRead, KVWritten

    class Truth(ModelTap):
        needs = frozenset({"kv"})

        def __init__(self):
            self.seen = []

        def on_kv(self, layer, k, v, batch):
            self.seen.append((layer, k.shape[0], float(k.abs().max()), float(v.abs().max())))

    if not fused:
        monkeypatch.setattr(engine.attn, "fuse_rope_write", False)
    elif not engine.attn.fused_rope_write(torch.float32, engine.kv.k[0]):
        pytest.skip("no fused store on this backend / build")
    if fused == "patched":
        real = engine.attn.rope_write
        monkeypatch.setattr(engine.attn, "rope_write", lambda *a: (real(*a), None)[1])
    got: list = []
    engine.bus.subscribe([KVWritten, AttentionRead], got.append)
    tap = Truth()
    instrumentation.add_tap(engine, tap)
    n_big = instrumentation.DEFER_ROWS + 30
    engine.generate([[7, 8, 9] * (n_big // 3 + 1), [5] * 11], SamplingParams(max_tokens=4, ignore_eos=True))
    measured_by_store = engine.model_hooks.store_measured     # the last forward's
    instrumentation.remove_tap(engine, tap)
    assert measured_by_store == (fused is True)
    L = engine.model_config.num_layers
    kv = [e for e in got if isinstance(e, KVWritten)]
    reads = [e for e in got if isinstance(e, AttentionRead)]
    assert len(kv) == len(tap.seen) == len(reads) and len(kv) % L == 0 and len(kv) >= 4 * L
    assert any(n > instrumentation.DEFER_ROWS for _, n, _, _ in tap.seen)          # both kinds of forward ran
    assert any(n <= instrumentation.DEFER_ROWS for _, n, _, _ in tap.seen)
    for e, (layer, n, km, vm) in zip(kv, tap.seen):
        assert (e.layer, e.num_tokens) == (layer, n)
        assert torch.isclose(torch.tensor(e.k_absmax), torch.tensor(km)) and \
            torch.isclose(torch.tensor(e.v_absmax), torch.tensor(vm))
    assert [e.layer for e in reads] == [e.layer for e in kv]
    for f in range(len(kv) // L):                                                     # per forward
        fwd = kv[f * L:(f + 1) * L]
        assert [e.layer for e in fwd] == list(range(L)) and all(a.t_ns <= b.t_ns for a, b in zip(fwd, fwd[1:]))
    # interleaved as they ran: each layer's KVWritten before its AttentionRead
    order = [(type(e).__name__, e.layer) for e in got]
    assert order[:2] == [("KVWritten", 0), ("AttentionRead", 0)]


def test_a_forward_that_raises_still_emits_what_its_layers_measured_before_step_failed(engine):
    # a decode's per-layer rows are held until its last layer; a forward that raises at layer 1
    # must still emit layers 0 and 1's rows (the failed step's record keeps them), before StepFailed,
    # and hold nothing afterwards
    from workbench.engine import instrumentation
    from workbench.engine.taps import ModelTap
    from workbench.events import AttentionRead, KVWritten, StepFailed

    class Boom(ModelTap):
        needs = frozenset({"kv"})
        armed = False

        def on_kv(self, layer, k, v, batch):
            if self.armed and layer == 1:
                raise RuntimeError("boom at layer 1")

    got: list = []
    engine.bus.subscribe([KVWritten, AttentionRead, StepFailed], got.append)
    tap = Boom()
    instrumentation.add_tap(engine, tap)
    engine.add_request([5, 6, 7] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()                                                     # the prefill, clean
    got.clear()
    tap.armed = True
    with pytest.raises(RuntimeError, match="boom at layer 1"):
        engine.step()                                                 # a decode: 1 row, deferred
    names = [(type(e).__name__, getattr(e, "layer", None)) for e in got]
    assert names == [("KVWritten", 0), ("AttentionRead", 0), ("KVWritten", 1), ("StepFailed", None)], names
    assert engine.model_hooks._deferred is None
    instrumentation.remove_tap(engine, tap)


def test_emit_rows_reaches_every_kind_of_subscriber_in_order_and_the_log_in_one_call():
    """emit_rows: a decode forward's per-layer rows at once. The event log (a `many` handler) gets
    them in one call and keeps them exactly as one emit_row each would; a plain row subscriber and
    an object subscriber get each in order; a failing `many` handler goes to on_error, the rest go on."""
    from workbench.events import AttentionRead, KVWritten
    items = []
    for layer in range(3):
        items += [(KVWritten, (7, 100 + layer, layer, 1.5 * layer, 2.0, 16)),
                  (AttentionRead, (7, 101 + layer, layer, 3, 99, 4096))]
    one, batch = EventBus(), EventBus()
    log_one, log_batch = EventLog(one), EventLog(batch)
    rows, objs, errors = [], [], []
    batch.subscribe_rows([KVWritten, AttentionRead], lambda t, r: rows.append((t, r)))
    batch.subscribe([KVWritten, AttentionRead], objs.append)
    calls = []
    orig = log_batch.record_rows
    log_batch.record_rows = lambda got: (calls.append(len(got)), orig(got))
    log_batch.detach()
    log_batch.attach(batch)                                  # subscribes the counting many-handler
    boom = lambda t, r: None                                 # noqa: E731
    batch.subscribe_rows([KVWritten], boom, many=lambda got: 1 / 0)
    batch.on_error = lambda fn, e, exc: errors.append((fn, type(e).__name__, type(exc).__name__))
    for t, r in items:
        one.emit_row(t, r)
    batch.emit_rows(items)
    assert calls == [len(items)]
    assert rows == items and [(type(e), e.layer) for e in objs] == [(t, r[2]) for t, r in items]
    for t in (KVWritten, AttentionRead):
        assert log_batch.frame(t).equals(log_one.frame(t))
    assert errors == [(boom, "KVWritten", "ZeroDivisionError")]
    batch.unsubscribe(boom)
    batch.emit_rows(items[:1])                               # the handler went with its subscriber
    assert len(errors) == 1


def test_emit_rows_to_the_log_alone_hands_it_the_list_and_keeps_order_and_bound():
    """With only handlers of many listening (the log), emit_rows hands them the list without a pass per
    row; the log's rows, seqs and interleaving are the ones one emit_row each gives, a short row still
    goes the slow way (built, with its defaults), and a batch larger than max_rows leaves it bounded."""
    from workbench.events import AttentionRead, KVWritten
    items = []
    for layer in range(40):
        items += [(KVWritten, (3, 10 + layer, layer, 0.5, 2.0, 16)), (AttentionRead, (3, 11 + layer, layer, 1, 2, 64))]
    one, batch = EventBus(), EventBus()
    log_one, log_batch = EventLog(one), EventLog(batch)
    taken = []
    assert batch._one_batch_taker(items) == [log_batch.record_row]
    orig = log_batch.record_rows
    log_batch.record_rows = lambda got: (taken.append(got), orig(got))
    log_batch.detach()
    log_batch.attach(batch)
    for t, r in items:
        one.emit_row(t, r)
    batch.emit_rows(items)
    assert len(taken) == 1 and taken[0] is items                     # the list itself: no pass per row
    for t in (KVWritten, AttentionRead):
        assert log_batch.frame(t).equals(log_one.frame(t))
    seqs = log_batch.frame(KVWritten)["seq"].tolist() + log_batch.frame(AttentionRead)["seq"].tolist()
    assert sorted(seqs) == list(range(len(items)))
    short = [(KVWritten, (3, 1, 0, 0.5))]                            # a row without every field: not the fast path
    assert batch._one_batch_taker(short) is None
    small = EventLog(EventBus(), max_rows=10)
    small.record_rows(items)
    assert all(n <= 10 for n in small._counts.values()) and small.dropped == len(items) - sum(small._counts.values())


@pytest.mark.parametrize("patched", [False, True])
def test_quiet_layers_stamp_their_rows_and_the_log_gets_the_same_rows(engine, patched, monkeypatch):
    """With nothing but the log listening, no layer of a decode calls the hooks: the model stamps
    each layer's store and read times, and end_forward builds the rows from the stamps and the store's
    measurement. The rows equal those of the same run with a tap at every layer (which calls the hooks
    at every layer), in the same order, each layer's store before its read."""
    import torch

    from workbench.engine import instrumentation
    from workbench.engine.taps import ModelTap
    from workbench.events import AttentionRead, KVWritten

    if not engine.attn.fused_rope_write(torch.float32, engine.kv.k[0]):
        pytest.skip("no fused store on this backend / build")

    class Every(ModelTap):
        needs = frozenset({"kv"})

        def on_kv(self, layer, k, v, batch):
            pass

    def run(tap):
        got: list = []
        engine.bus.subscribe([KVWritten, AttentionRead], got.append)
        if tap is not None:
            instrumentation.add_tap(engine, tap)
        quiet_seen = []
        orig = engine.model_hooks.end_forward

        def end_forward(batch):
            quiet_seen.append(sum(engine.model_hooks.quiet))
            return orig(batch)
        engine.model_hooks.end_forward = end_forward
        try:
            engine.reset_prefix_cache()
            engine.generate([[7, 8, 9] * 5, [5] * 11] + ([[3, 4] * 40] if long_prompt else []),
                            SamplingParams(max_tokens=4, ignore_eos=True))
        finally:
            del engine.model_hooks.end_forward
            engine.bus.unsubscribe(got.append)
            if tap is not None:
                instrumentation.remove_tap(engine, tap)
        return got, quiet_seen

    long_prompt = True                                          # a forward over DEFER_ROWS rows too (deferred: measured)
    loud, loud_q = run(Every())
    if patched:          # a store that measures nothing the hooks trust: quiet layers still call on_kv
        real = engine.attn.rope_write
        monkeypatch.setattr(engine.attn, "rope_write", lambda *a: (real(*a), None)[1])
    quiet, quiet_q = run(None)
    L = engine.model_config.num_layers
    assert max(loud_q) == 0 and max(quiet_q) == L                  # the quiet path did run
    key = lambda e: (type(e).__name__, e.layer, getattr(e, "num_tokens", None),      # noqa: E731
                     getattr(e, "k_absmax", None), getattr(e, "v_absmax", None), getattr(e, "bytes_read", None))
    assert len(quiet) == len(loud) >= 4 * 2 * L
    if patched:              # the hooks' own reduction against the store's: the same floats, or within rounding
        for a, b in zip(quiet, loud):
            assert key(a)[:3] == key(b)[:3] and key(a)[5] == key(b)[5]
            if isinstance(a, KVWritten):
                assert abs(a.k_absmax - b.k_absmax) <= 1e-6 * b.k_absmax and abs(a.v_absmax - b.v_absmax) <= 1e-6 * b.v_absmax
    else:
        assert [key(e) for e in quiet] == [key(e) for e in loud]
    for f in range(len(quiet) // (2 * L)):
        fwd = quiet[f * 2 * L:(f + 1) * 2 * L]
        assert all(a.t_ns <= b.t_ns for a, b in zip(fwd, fwd[1:]))       # store, read, next layer ...


def test_a_bf16_model_s_per_layer_rows_where_no_store_measures(tiny_llama_dir, monkeypatch):
    """bf16 rows the hooks measure themselves (the store unfused through its seam), on a prefill over
    DEFER_ROWS rows (emitted at each layer) and the decodes after it: every KVWritten row is the
    layer's own K / V absmax, as a tap reduces them."""
    import torch

    from workbench.engine import instrumentation
    from workbench.engine.taps import ModelTap
    from workbench.events import KVWritten

    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, dtype="bfloat16"))
    monkeypatch.setattr(eng.attn, "fuse_rope_write", False)

    class Truth(ModelTap):
        needs = frozenset({"kv"})

        def __init__(self):
            self.seen = []

        def on_kv(self, layer, k, v, batch):
            self.seen.append((layer, k.shape[0], float(k.float().abs().max()), float(v.float().abs().max())))

    got: list = []
    eng.bus.subscribe(KVWritten, got.append)
    tap = Truth()
    instrumentation.add_tap(eng, tap)
    eng.generate([[3, 4] * 50], SamplingParams(max_tokens=3, ignore_eos=True))
    instrumentation.remove_tap(eng, tap)
    assert len(got) == len(tap.seen) and any(n > instrumentation.DEFER_ROWS for _, n, _, _ in tap.seen)
    for e, (layer, n, km, vm) in zip(got, tap.seen):
        assert (e.layer, e.num_tokens) == (layer, n) and e.k_absmax == km and e.v_absmax == vm
