"""fp16 overflow: the per-page scaled KV cache, the fp16_kv_overflow fault and the probe that names it."""
import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine import kv_scale
from workbench.engine.attention import TorchPagedAttention
from workbench.engine.batch import BatchBuilder
from workbench.engine.sequence import Sequence

FP16_MAX = 65504.0
HKV, D, PS = 2, 16, 16
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def sampled(n):     # seeded sampling: every token depends on the exact logits, unlike a greedy tiny model
    return [SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(n)]


def prompts(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(5, 70))).tolist() for _ in range(n)]


def engine(path, kv="float32", **kw):
    return Engine.from_pretrained(path, EngineConfig(num_pages=64, kv_cache_dtype=kv, **kw))


def tokens(eng, ps, params):
    return [o.token_ids for o in eng.generate(ps, params)]


@pytest.fixture(scope="module")
def clean_fp32(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    ps = prompts()
    return ps, tokens(eng, ps, GREEDY), tokens(eng, ps, sampled(len(ps)))


# ---- the per-page scales against a dense reference ------------------------------------
def scaled_cache(num_pages):
    return kv_scale.attach_scale(torch.zeros(num_pages, PS, HKV, D, dtype=torch.float16))


def read_back(cache, pages):
    """Whole pages through the attention backend's gather (the read path decode uses)."""
    attn = TorchPagedAttention(HKV * 2, HKV, D)
    return attn.gather(cache, torch.tensor(pages), 1, torch.float32)[0]


def test_round_trip_error_is_bounded_by_each_pages_absmax():
    rng = np.random.default_rng(1)
    mags = [1e-6, 1e-3, 0.5, 300.0, 6e4, 7e4, 1e6, 3e9]         # beyond 65504 too: no inf
    n_pages = len(mags)
    x = torch.cat([torch.randn(PS, HKV, D) * m for m in mags])
    cache = scaled_cache(n_pages + 2)
    pages = rng.permutation(n_pages + 2)[:n_pages].tolist()        # scattered over the pool
    slots = torch.tensor([p * PS + o for p in pages for o in range(PS)])
    kv_scale.write_scaled(x, cache, cache.page_scale, kv_scale.plan_write(slots, PS))
    got = read_back(cache, pages).view(n_pages, PS, HKV, D)
    ref = x.view(n_pages, PS, HKV, D)
    assert torch.isfinite(got).all()
    for i in range(n_pages):
        absmax = ref[i].abs().max()
        err = (got[i] - ref[i]).abs().max()
        assert err <= absmax * 2 ** -10, (mags[i], float(err / absmax))
        # the stored page sits well inside fp16's range, whatever the magnitude
        assert 2 ** 14 <= cache[pages[i]].float().abs().max() <= 2 ** 15
    # plain fp16 loses what the scales keep: the reference cast overflows / flushes
    assert not torch.isfinite(x[-PS:].half()).all()


@pytest.mark.parametrize("sync_free", [False, True])     # True: the accelerator path, no host sync
def test_page_filled_over_steps_with_growing_values_equals_one_write(sync_free):
    """A page's scale grows as larger tokens arrive; its earlier tokens are rescaled exactly."""
    rng = np.random.default_rng(2)
    pages = [5, 2, 9]                         # three sequences, one page each, filled side by side
    chunks = [1, 3, 1, 5, 1, 2, 3]            # tokens per step (prefill chunks and decodes)
    total = sum(chunks)
    growth = 10.0 ** np.linspace(-2, 7, total)
    vals = torch.randn(len(pages), total, HKV, D) * torch.tensor(growth, dtype=torch.float32)[None, :, None, None]
    vals[1] = vals[1].flip(1)                 # one page shrinks instead: its scale must stay
    stepwise, once = scaled_cache(12), scaled_cache(12)
    start = 0
    for n in chunks:
        slots = torch.tensor([p * PS + o for p in pages for o in range(start, start + n)])
        x = vals[:, start:start + n].reshape(-1, HKV, D)
        kv_scale.write_scaled(x, stepwise, stepwise.page_scale, kv_scale.plan_write(slots, PS), sync_free)
        start += n
    slots = torch.tensor([p * PS + o for p in pages for o in range(total)])
    kv_scale.write_scaled(vals.reshape(-1, HKV, D), once, once.page_scale, kv_scale.plan_write(slots, PS))
    assert torch.equal(stepwise.page_scale, once.page_scale)
    # bit for bit, except where fp16 goes subnormal (there the earlier rounding may round twice)
    normal = once[pages, :total].float().abs() >= 2 ** -14
    assert torch.equal(stepwise[pages, :total][normal], once[pages, :total][normal])
    got = read_back(stepwise, pages).view(len(pages), PS, HKV, D)[:, :total]
    for i in range(len(pages)):
        assert (got[i] - vals[i]).abs().max() <= vals[i].abs().max() * 2 ** -10


def test_a_reused_page_does_not_inherit_its_previous_scale():
    cache = scaled_cache(4)
    big = torch.randn(PS, HKV, D) * 1e6
    kv_scale.write_scaled(big, cache, cache.page_scale, kv_scale.plan_write(torch.arange(PS) + 3 * PS, PS))
    small = torch.randn(4, HKV, D) * 1e-3    # the page handed to another request, written from offset 0
    kv_scale.write_scaled(small, cache, cache.page_scale, kv_scale.plan_write(torch.arange(4) + 3 * PS, PS))
    got = read_back(cache, [3])[:4]
    assert (got - small).abs().max() <= small.abs().max() * 2 ** -10


def test_paged_attention_over_scaled_pages_matches_dense_where_fp16_overflows():
    """Decode and a chunk after a prefix, over K/V around 1e5, against float64 attention."""
    rng = np.random.default_rng(3)
    hq = 2 * HKV
    attn = TorchPagedAttention(hq, HKV, D)
    specs = [(37, 1), (16, 9), (70, 1)]       # (tokens already cached, tokens this step)
    kc, vc = scaled_cache(40), scaled_cache(40)
    perm = rng.permutation(40).tolist()
    seqs, full, sched = [], [], []
    for i, (cached, new) in enumerate(specs):
        n = cached + new
        s = Sequence(i, list(range(n)), SamplingParams(), max_len=n + 1)
        s.pages = [perm.pop() for _ in range(-(-n // PS))]
        k, v = torch.randn(n, HKV, D) * 3e4, torch.randn(n, HKV, D) * 2e5
        s.num_computed_tokens = 0                  # write the prefix as an earlier step would
        if cached:
            pre = BatchBuilder(512, 8, 16, PS, torch.device("cpu")).build([(s, cached)])
            attn.write_kv(k[:cached], v[:cached], kc, vc, pre)
        s.num_computed_tokens = cached
        seqs.append(s)
        full.append((k, v))
        sched.append((s, new))
    b = BatchBuilder(512, 8, 16, PS, torch.device("cpu")).build(sched)
    k_new = torch.cat([k[c:] for (k, _), (c, _) in zip(full, specs)])
    v_new = torch.cat([v[c:] for (_, v), (c, _) in zip(full, specs)])
    q = torch.randn(k_new.shape[0], hq, D) * 1e-4
    attn.write_kv(k_new, v_new, kc, vc, b)
    out = attn.forward(q, k_new, v_new, kc, vc, b)
    cu = b.cu_seqlens_q_np
    for i, ((k, v), (cached, new)) in enumerate(zip(full, specs)):
        qi = q[cu[i]:cu[i + 1]].double()
        kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
        s = torch.einsum("nhd,chd->hnc", qi, kk) / D ** 0.5
        allowed = torch.arange(cached + new)[None, :] <= (cached + torch.arange(new))[:, None]
        ref = torch.einsum("hnc,chd->nhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
        assert torch.isfinite(out[cu[i]:cu[i + 1]]).all()
        assert (out[cu[i]:cu[i + 1]].double() - ref).abs().max() <= vv.abs().max() * 2 ** -10, i


# ---- the fault, the scaled cache and the probe on the engine -----------------------------
def pages_per_step(eng, ps, params):
    """Run to completion step by step; {step: {request_id: pages}} and the outputs."""
    rids = [eng.add_request(p, x) for p, x in zip(ps, params)]
    held, outs = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        held[eng.step_count] = {s.request_id: list(s.pages) for s in eng.live_sequences()}
    return held, [outs[r] for r in rids]


def test_fault_on_fp16_cache_garbles_output_and_the_probe_names_layer_page_request(tiny_llama_dir, clean_fp32):
    ps, ref_greedy, ref_sampled = clean_fp32
    eng = engine(tiny_llama_dir, "float16")
    wb = Workbench(eng, log=False).attach("fp16_overflow")          # default: every 4th step
    with faults.inject(eng, "fp16_kv_overflow") as fault:
        assert fault.layer == 1 and fault.factor > 1                # the middle layer of 2
        held, greedy = pages_per_step(eng, ps, [GREEDY] * len(ps))
        samp = tokens(eng, ps, sampled(len(ps)))                    # NaN logits must not crash sampling
    assert greedy != ref_greedy and samp != ref_sampled
    assert sum(t == 0 for out in greedy for t in out) > len(ps)       # argmax of a NaN row: token 0, "<unk>"
    errors = wb.findings_at_least("error")
    kinds = {f.kind for f in errors}
    assert {"fp16-kv-overflow", "fp16-nonfinite"} <= kinds
    assert all(f.layer == fault.layer for f in errors)
    checked = 0
    for f in errors:
        if f.request_id in held.get(f.step, {}):                    # the request held that page then
            assert f.page in held[f.step][f.request_id], f
            checked += 1
        assert "fp16_scaled" in f.hint
    assert checked >= 2
    over = next(f for f in errors if f.kind == "fp16-kv-overflow")
    assert over.step == 1 and over.evidence["k_absmax"] > FP16_MAX
    # the engine runs clean after the with-block: weights back, no inf left in the pages
    assert tokens(eng, ps, GREEDY) == ref_greedy
    assert all(torch.isfinite(t).all() for t in eng.kv.k + eng.kv.v)


def test_finding_names_the_first_layer_when_nan_spreads_downstream(tiny_llama_dir):
    eng = engine(tiny_llama_dir, "float16")
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    with faults.inject(eng, "fp16_kv_overflow", layer=0):
        eng.generate(prompts(3, seed=5), GREEDY)
    nonfinite = [f for f in wb.findings_at_least("error") if f.kind == "fp16-nonfinite"]
    assert nonfinite and nonfinite[0].layer == 0
    assert nonfinite[0].evidence["layers"] == [0, 1]                 # layer 1 is only downstream
    df = wb.probe("fp16_overflow").frame()
    assert (df[df.layer == 1]["hidden_nonfinite"] > 0).any()        # the heatmap shows both


def test_fp16_scaled_cache_under_the_fault_answers_like_fp32(tiny_llama_dir, clean_fp32):
    ps, ref_greedy, ref_sampled = clean_fp32
    eng = engine(tiny_llama_dir, "fp16_scaled")
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    with faults.inject(eng, "fp16_kv_overflow") as fault:
        assert tokens(eng, ps, GREEDY) == ref_greedy
        assert tokens(eng, ps, sampled(len(ps))) == ref_sampled
    assert not wb.findings_at_least("warn")
    absorbed = [f for f in wb.probe("fp16_overflow").findings if f.kind == "fp16-kv-overflow"]
    assert absorbed and absorbed[0].severity == "info" and absorbed[0].layer == fault.layer
    scales = torch.cat(eng.kv.scales(fault.layer))
    assert scales.max() > 1.0                                       # the pages really were scaled down


def test_fault_keeps_the_fp32_model_exact(tiny_llama_dir, clean_fp32):
    """Only the fp16 cast breaks: the float32 model under the fault answers bit for bit."""
    ps, ref_greedy, ref_sampled = clean_fp32
    eng = engine(tiny_llama_dir, "float32")
    wb = Workbench(eng, log=False).attach("fp16_overflow")
    layer = eng.model.layers[1]
    before = (layer.qkv, layer.o)
    with faults.inject(eng, "fp16_kv_overflow"):
        assert (layer.qkv, layer.o) != before
        assert tokens(eng, ps, sampled(len(ps))) == ref_sampled
    assert (layer.qkv, layer.o) == before
    found = wb.findings_at_least("warn")
    assert found and {f.severity for f in found} == {"warn"}         # a latent fp16 hazard, not a failure


def test_fault_off_no_findings_and_fp16_matches_fp32(tiny_llama_dir, clean_fp32):
    ps, ref_greedy, _ = clean_fp32
    eng = engine(tiny_llama_dir, "float16")
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    assert tokens(eng, ps, GREEDY) == ref_greedy
    assert not wb.findings_at_least("warn")
    df = wb.probe("fp16_overflow").frame()
    assert len(df) == 2 * eng.step_count and (df["headroom"] < 0.1).all()      # far below the warn line
    pages = wb.probe("fp16_overflow").page_frame()
    assert not pages.empty and set(pages["layer"]) == {0, 1}
    # the per-page maxima of a step and layer are the layer's absmax, split by page
    per_layer = pages.groupby(["step", "layer"])[["k_absmax", "v_absmax"]].max().reset_index()
    joined = per_layer.merge(df, on=["step", "layer"], suffixes=("_pages", ""))
    assert len(joined) == len(df)
    for c in ("k_absmax", "v_absmax"):
        assert np.allclose(joined[c + "_pages"], joined[c], rtol=1e-6)


def test_probe_samples_every_nth_step_and_is_unwired_when_detached(tiny_llama_dir):
    eng = engine(tiny_llama_dir, "float16")
    assert eng.model.hooks is None
    wb = Workbench(eng, log=False).attach("fp16_overflow")
    probe = wb.probe("fp16_overflow")
    assert eng.model.hooks is not None
    eng.generate(prompts(2), GREEDY)
    steps = eng.step_count
    assert probe.measured_steps == -(-steps // 4) and len(probe.frame()) == 2 * probe.measured_steps
    assert sorted(set(probe.frame()["step"])) == list(range(1, steps + 1, 4))
    # an unmeasured forward costs one guarded call (forward_layers: no layer), a measured one that plus
    # on_q and on_kv per layer (the fused store does not write an fp16 cache, so it measures nothing) and
    # on_hidden at the last layer where the compiled norms measure the others, at every layer elsewhere
    from workbench.engine.model import norm_measures
    L = eng.model_config.num_layers
    hidden = 1 if norm_measures(torch.zeros(1, 4)) else L
    assert probe.calls == steps + probe.measured_steps * (2 * L + hidden)
    wb.detach("fp16_overflow")
    assert eng.model.hooks is None and eng.model_hooks.taps == []


@pytest.mark.slow
def test_smollm2_fp16_answers_garbage_and_fp16_scaled_answers_like_fp32(smollm2_path, smollm2_engine):
    """The production symptom on a real model: fp16 KV -> '<|endoftext|>' and nothing; scaled -> the answer."""
    from workbench.engine.weights import load_model
    msgs = [[{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = smollm2_engine.generate(msgs, params)[0]
    assert "Paris" in ref.text
    loaded = load_model(smollm2_path, torch.float32)
    got = {}
    for kv in ("float16", "fp16_scaled"):
        eng = Engine(loaded, EngineConfig(num_pages=32, kv_cache_dtype=kv))
        wb = Workbench(eng, log=False).attach("fp16_overflow")
        with faults.inject(eng, "fp16_kv_overflow") as fault:
            got[kv] = eng.generate(msgs, params)[0]
        got[kv + "_errors"] = wb.findings_at_least("error")
    assert got["fp16_scaled"].token_ids == ref.token_ids and not got["fp16_scaled_errors"]
    bad = got["float16"]
    assert bad.token_ids != ref.token_ids and "Paris" not in bad.text
    assert got["float16_errors"] and got["float16_errors"][0].layer == fault.layer == 15


def test_score_bound_from_the_models_q_equals_the_recomputed_one(tiny_llama_dir, monkeypatch):
    """The probe takes q from the model's hook (no extra qkv matmul); RoPE preserves per-head
    norms, so the bound must equal the one recomputed from the layer input."""
    from workbench.engine import model as model_mod
    from workbench.engine.instrumentation import ModelHooks
    bounds = []
    for hand_q in (True, False):
        eng = engine(tiny_llama_dir, "float32")
        wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
        probe = wb.probe("fp16_overflow")
        if not hand_q:
            del probe._tap.on_q                                     # as a model that does not pass q
            # and no store or norm measuring for it: q recomputed from each layer's input, tracked through them
            monkeypatch.setattr(ModelHooks, "kv_absmax_buffer", lambda self, t, n: None)
            monkeypatch.setattr(model_mod, "norm_measures", lambda x: False)
        eng.generate(prompts(3, seed=7), GREEDY)
        bounds.append(probe.frame()["score_bound"].to_numpy())
        wb.detach()
    assert len(bounds[0]) > 0 and np.isfinite(bounds[0]).all()
    assert np.allclose(bounds[0], bounds[1], rtol=1e-4)


def test_measured_steps_see_every_rows_last_hidden_state(tiny_llama_dir):
    """The model runs its last layer for the sampled rows only, except on the small forwards the
    probe measures (at most STASH_ROWS rows): there every token's last hidden state is computed and
    measured. A big measured prefill keeps the pruning (a layer's worth of its linears): its last
    layer is measured over the sampled rows."""
    from probes.fp16_overflow import STASH_ROWS
    for budget in (48, 4 * STASH_ROWS):
        eng = engine(tiny_llama_dir, enable_prefix_caching=False, max_num_batched_tokens=budget)
        wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 2})
        probe = wb.probe("fp16_overflow")
        down = eng.model.layers[-1].down
        real_add, seen = down.add, []
        down.add = lambda x, other: (seen.append((eng.step_count, x.shape[0], eng.last_batch.num_tokens,
                                                  int(eng.last_batch.logits_indices.shape[0]))),
                                     real_add(x, other))[1]
        eng.generate(prompts(4), GREEDY)
        measured = set(probe.frame()["step"].tolist())
        partial = [(step, rows, t, s) for step, rows, t, s in seen if s < t]      # steps with unsampled rows
        assert any(step in measured for step, *_ in partial)
        if budget <= STASH_ROWS:
            assert any(step not in measured for step, *_ in partial)
        for step, rows, t, s in partial:
            keeps_all = step in measured and t <= STASH_ROWS
            assert rows == (t if keeps_all else s), (budget, step, rows, t, s)
        last = probe.frame().to_dict("records")
        last = [r for r in last if r["layer"] == eng.model_config.num_layers - 1]
        assert last and all(r["tokens"] > 0 and np.isfinite(r["hidden_absmax"]) and r["hidden_absmax"] > 0
                            for r in last)
        if budget > STASH_ROWS:
            assert any(t > STASH_ROWS for step, _, t, _ in partial if step in measured)


def test_a_small_forward_reduced_at_its_end_equals_the_per_layer_reductions(tiny_llama_dir, monkeypatch):
    """The few-row path keeps each layer's K, V, q and h (views) and reduces them once after the last
    layer: every figure equals the per-layer path's, so nothing the model wrote later changed them."""
    # Each way with K / V absmax measured by the fused store as it wrote them, and without (the
    # hooks' buffer refused: the probe reduces the K / V it was handed): the same figures.
    import probes.fp16_overflow as fo
    from workbench.engine.instrumentation import ModelHooks
    got, by_store = [], []
    real = ModelHooks.kv_absmax_buffer
    for stash in (fo.STASH_ROWS, 0):
        for store in (True, False):
            monkeypatch.setattr(fo, "STASH_ROWS", stash)
            monkeypatch.setattr(ModelHooks, "kv_absmax_buffer", real if store else (lambda self, t, n: None))
            eng = engine(tiny_llama_dir, "float32")
            wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
            eng.generate(prompts(3, seed=5), GREEDY)
            by_store.append(eng.model_hooks.forward_row_stats() is not None)
            df = wb.probe("fp16_overflow").frame()
            got.append(df[["step", "layer", "k_absmax", "v_absmax", "hidden_absmax", "score_bound", "tokens"]].to_numpy())
    assert by_store == [eng.attn.fused_rope_write(torch.float32, eng.kv.k[0]), False] * 2
    assert all(g.shape == got[0].shape for g in got) and len(got[0]) > 0
    for g in got[1:]:
        assert np.allclose(got[0], g, rtol=1e-6, equal_nan=True)


def test_layers_the_store_and_norms_measured_call_no_tap_and_the_others_do(tiny_llama_dir, monkeypatch):
    """The probe reads the fused store's buffer ("row_stats") and the norms' ("hidden_absmax"): the hooks
    call its on_kv nowhere the store measured and its on_hidden at the last layer only (no later norm reads
    it). A layer the store reports unmeasured (the real seam: rope_write answering False) calls on_kv there;
    norms that do not measure (model.norm_measures False: the torch path) call on_hidden at every layer; and
    the figures (small stashed forwards and big prefills alike) equal a run where everything was measured."""
    import probes.fp16_overflow as fo
    from workbench.engine import model as model_mod
    eng = engine(tiny_llama_dir, "float32")
    if not eng.attn.fused_rope_write(torch.float32, eng.kv.k[0]):
        pytest.skip("no fused store on this CPU: every layer calls on_kv")
    last = eng.model_config.num_layers - 1
    real_on_kv, real_on_hidden, seen, hidden = fo.FP16OverflowProbe._on_kv, fo.FP16OverflowProbe._on_hidden, [], []
    monkeypatch.setattr(fo.FP16OverflowProbe, "_on_kv",
                        lambda self, layer, k, v, batch: (seen.append((k.shape[0], layer)), real_on_kv(self, layer, k, v, batch))[1])
    monkeypatch.setattr(fo.FP16OverflowProbe, "_on_hidden",
                        lambda self, layer, h, batch: (hidden.append(layer), real_on_hidden(self, layer, h, batch))[1])
    cols = ["step", "layer", "k_absmax", "v_absmax", "hidden_absmax", "score_bound", "tokens"]
    frames = []
    for unmeasured in (None, 1, "norms"):
        seen.clear()
        hidden.clear()
        if unmeasured == 1:
            real_rw = type(eng.attn).rope_write
            monkeypatch.setattr(type(eng.attn), "rope_write", lambda self, qkv, cos, sin, kc, vc, batch:
                                real_rw(self, qkv, cos, sin, kc, vc, batch) and batch.kv_layer != 1)
        if unmeasured == "norms":
            monkeypatch.setattr(model_mod, "norm_measures", lambda x: False)
        eng = engine(tiny_llama_dir, "float32", enable_prefix_caching=False)
        wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
        eng.generate(prompts(3, seed=5), GREEDY)
        frames.append(wb.probe("fp16_overflow").frame()[cols].to_numpy())
        wb.detach()
        layers = {layer for _, layer in seen}
        assert layers == ({1} if unmeasured is not None else set()), layers     # (1 stays patched)
        if unmeasured is not None:       # both kinds of forward went through the unmeasured layer's on_kv
            assert {rows <= fo.STASH_ROWS for rows, _ in seen} == {True, False}
        assert set(hidden) == (set(range(last + 1)) if unmeasured == "norms" else {last}), set(hidden)
    assert len(frames[0]) > 0 and all(f.shape == frames[0].shape for f in frames)
    assert np.allclose(frames[0], frames[1], rtol=1e-6, equal_nan=True)
    assert np.allclose(frames[0], frames[2], rtol=1e-4, equal_nan=True)    # torch's norm rounds otherwise


def test_a_layer_neither_measured_nor_handed_is_not_judged(tiny_llama_dir, monkeypatch):
    """A probe call that fails at one layer (an fp16 cache: the store measures nothing, on_kv is called at
    every layer) leaves that layer's figures unknown: the probe says it failed (probe-error) and judges no
    measured step on what it does not have (the store's buffer there holds no figures of that layer)."""
    import probes.fp16_overflow as fo
    real = fo.FP16OverflowProbe._on_kv

    def on_kv(self, layer, k, v, batch):
        if layer == 1:
            raise RuntimeError("planted: the probe's own call fails at layer 1")
        return real(self, layer, k, v, batch)
    monkeypatch.setattr(fo.FP16OverflowProbe, "_on_kv", on_kv)
    eng = engine(tiny_llama_dir, "float16")
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    eng.generate(prompts(2), GREEDY)
    probe = wb.probe("fp16_overflow")
    assert [f.kind for f in probe.findings] == ["probe-error"] and "layer 1" in probe.findings[0].message
    assert probe.measured_steps == 0 and probe.frame().empty
    wb.detach()


def test_an_inner_layers_hidden_state_past_fp16_is_named_by_layer_request_and_position(tiny_llama_dir, monkeypatch):
    """A bug planted in the real path (layer 0's residual add makes one decode row's hidden state 1e5): the
    text changes, and the probe, reading that layer's hidden state as layer 1's compiled norm measured it (no
    call of its own there), names layer 0, the step, the request and the position of the row."""
    from workbench.engine.model import norm_measures
    ps = prompts(3, seed=5)
    clean = tokens(engine(tiny_llama_dir, "float32", enable_prefix_caching=False), ps, GREEDY)
    eng = engine(tiny_llama_dir, "float32", enable_prefix_caching=False)
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    down, planted, buffers = eng.model.layers[0].down, {}, []
    real_add = down.add

    def add(x, other):
        out = real_add(x, other)
        b = eng.last_batch
        if not planted and eng.step_count >= 4 and b.num_tokens == len(b.seqs):       # a decode forward
            out[-1, 3] = 1e5
            planted.update(step=eng.step_count, request_id=b.seqs[-1].request_id, position=int(b.positions[-1]))
            buffers.append(eng.model_hooks.hidden_buffer() is not None)
        return out
    monkeypatch.setattr(down, "add", add)
    got = tokens(eng, ps, GREEDY)
    assert planted and got != clean                                   # the bug really changed the text
    (f,) = [f for f in wb.all_findings() if f.kind == "fp16-hidden-overflow"]
    assert f.severity == "warn" and f.layer == 0 and f.step == planted["step"]    # float32 model: would overflow
    assert f.request_id == planted["request_id"] and f.evidence["position"] == planted["position"]
    assert f.evidence["hidden_absmax"] == pytest.approx(1e5)
    assert buffers == [norm_measures(torch.zeros(1, 4))]              # measured by the norm where it is compiled
    wb.detach()


def test_the_measured_history_is_bounded_and_keeps_the_latest_steps(tiny_llama_dir):
    """A probe must not become the leak it hunts: frame()'s rows stay within max_history (the older
    half dropped), the newest measured steps kept, one row per layer each; a bad bound is refused."""
    eng = engine(tiny_llama_dir, "float16")
    L = eng.model_config.num_layers
    with pytest.raises(ValueError, match="max_history"):
        Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"max_history": 0})
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1, "max_history": 5 * L})
    probe = wb.probe("fp16_overflow")
    eng.generate(prompts(2), GREEDY)
    steps = eng.step_count
    assert probe.measured_steps == steps > 5                        # every step measured, more than it keeps
    df = probe.frame()
    assert 0 < len(df) <= 5 * L and len(df) % L == 0
    assert df["step"].max() == steps and sorted(set(df["step"])) == list(range(steps - len(df) // L + 1, steps + 1))
    assert (df.groupby("step")["layer"].apply(sorted) == [list(range(L))] * (len(df) // L)).all()
    assert df[["k_absmax", "v_absmax", "hidden_absmax"]].notna().all().all()
    probe.reset()
    assert probe.frame().empty and list(probe.frame().columns) == probe.COLUMNS
