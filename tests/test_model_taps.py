"""Model taps: one interface (taps.ModelTap), fed only what its `needs` declare, checked at add_tap."""
import pytest

from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine import instrumentation
from workbench.engine.taps import ModelTap

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5, [4] * 13]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def eng(tiny_llama_dir):
    return Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, enable_prefix_caching=False))


def test_a_kv_tap_gets_on_kv_and_nothing_else(eng):
    want = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]

    class KV(ModelTap):                  # the base's other methods raise if called
        needs = frozenset({"kv"})

        def __init__(self):
            self.calls = []

        def on_kv(self, layer, k, v, batch):
            self.calls.append((layer, k.shape[0], batch.num_tokens))

    tap = KV()
    instrumentation.add_tap(eng, tap)
    got = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    instrumentation.remove_tap(eng, tap)
    L = eng.model_config.num_layers
    assert got == want and eng.model.hooks is None and eng.model_hooks.taps == []
    assert len(tap.calls) == L * PARAMS.max_tokens                # one prefill, 3 decode forwards
    assert [c[0] for c in tap.calls] == list(range(L)) * (len(tap.calls) // L)
    assert all(t == n for _, t, n in tap.calls)          # every row's K/V


def test_add_tap_rejects_what_it_cannot_feed_and_the_engine_runs_on(eng):
    class Duck:                          # the old duck-typed tap
        def on_kv(self, layer, k, v, batch):
            pass

    class Unknown(ModelTap):
        needs = frozenset({"kv", "logits"})

        def on_kv(self, layer, k, v, batch):
            pass

    class NoOut(ModelTap):
        needs = frozenset({"kv", "attention_out"})

        def on_kv(self, layer, k, v, batch):
            pass

    class Empty(ModelTap):
        pass

    class Unasked(ModelTap):             # reads_every_row() without declaring every_row_hidden
        needs = frozenset({"hidden"})

        def on_hidden(self, layer, h, batch):
            pass

        def reads_every_row(self):
            return False

    cases = [(Duck(), TypeError, r"Duck is not a ModelTap"),
             (Unknown(), ValueError, r"Unknown\.needs: unknown need\(s\) \['logits'\]"),
             (NoOut(), TypeError, r"NoOut declares 'attention_out' but does not implement on_attention_out\(\)"),
             (Empty(), ValueError, r"Empty\.needs is empty"),
             (Unasked(), TypeError, r"Unasked overrides reads_every_row\(\)")]
    for tap, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            instrumentation.add_tap(eng, tap)
        assert eng.model_hooks.taps == [] and eng.model.hooks is None
    out = eng.generate(PROMPTS, PARAMS)
    assert [len(o.token_ids) for o in out] == [4] * len(PROMPTS)

    with pytest.raises(NotImplementedError, match="on_hidden"):   # an undeclared method is not a silent no-op
        NoOut().on_hidden(0, None, None)
    tap = NoOut()
    tap.on_attention_out = lambda layer, o, batch: None           # set on the instance (a probe's guarded fn)
    instrumentation.add_tap(eng, tap)
    assert eng.model_hooks.taps == [tap]
    instrumentation.remove_tap(eng, tap)


class LastRows(ModelTap):
    """Records, per forward, (rows of h after the last layer, batch tokens, sampled rows)."""

    def __init__(self, needs, last, every_row=None):
        self.needs, self.last, self.every_row, self.seen = frozenset(needs), last, every_row, []

    def on_hidden(self, layer, h, batch):
        if layer == self.last:
            self.seen.append((h.shape[0], batch.num_tokens, int(batch.logits_indices.shape[0])))


class Sometimes(LastRows):
    def reads_every_row(self):
        return self.every_row()


def test_only_a_tap_declaring_every_row_keeps_the_last_layers_rows(eng):
    last = eng.model_config.num_layers - 1

    def run(tap):
        instrumentation.add_tap(eng, tap)
        try:
            eng.generate(PROMPTS, PARAMS)
        finally:
            instrumentation.remove_tap(eng, tap)
        return tap.seen

    seen = run(LastRows({"hidden"}, last))
    assert any(n > s for _, n, s in seen)                  # prefill forwards: fewer sampled rows than tokens
    assert all(h == s for h, _, s in seen)                 # pruned to the sampled rows
    seen = run(LastRows({"every_row_hidden"}, last))
    assert any(n > s for _, n, s in seen) and all(h == n for h, n, _ in seen)
    calls = []              # declared, but asked each forward that could prune (fp16's measured steps)
    seen = run(Sometimes({"every_row_hidden"}, last, lambda: calls.append(1) or len(calls) == 1))
    assert seen[0][0] == seen[0][1] > seen[0][2] and all(h == s for h, _, s in seen[1:])
    assert len(calls) == sum(n > s for _, n, s in seen)   # a decode forward samples every row: not asked


def test_a_tap_scoping_its_layers_is_called_at_those_only(eng):
    """forward_layers(batch), asked once per forward: the hooks call the tap at the layers it names
    (True: all, anything else: none); the other taps still see every layer."""
    L = eng.model_config.num_layers
    plan = iter([True, {L - 1}, (), None])      # PARAMS: one prefill and three decode forwards

    class Scoped(ModelTap):
        needs = frozenset({"q", "kv", "attention_out"})

        def __init__(self):
            self.asked, self.calls = 0, []

        def forward_layers(self, batch):
            self.asked += 1
            return next(plan)

        def on_q(self, layer, q):
            self.calls.append((self.asked, "q", layer))

        def on_kv(self, layer, k, v, batch):
            self.calls.append((self.asked, "kv", layer))

        def on_attention_out(self, layer, o, batch):
            self.calls.append((self.asked, "out", layer))

    class Every(ModelTap):
        needs = frozenset({"kv"})

        def __init__(self):
            self.layers = []

        def on_kv(self, layer, k, v, batch):
            self.layers.append(layer)

    want = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    scoped, every = Scoped(), Every()
    instrumentation.add_tap(eng, scoped)
    instrumentation.add_tap(eng, every)
    try:
        got = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    finally:
        instrumentation.remove_tap(eng, scoped)
        instrumentation.remove_tap(eng, every)
    assert got == want
    assert scoped.asked == PARAMS.max_tokens                        # once per forward
    by_forward = {}
    for f, what, layer in scoped.calls:
        by_forward.setdefault(f, set()).add(layer)
    assert by_forward == {1: set(range(L)), 2: {L - 1}}             # (): none; None (a failed guard): none
    assert every.layers == list(range(L)) * PARAMS.max_tokens        # the unscoped tap: every layer, every forward
