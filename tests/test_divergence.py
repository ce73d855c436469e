"""Issue 29, first part: divergence triage between two sides, drift or corruption, and the first bad token.

The engine's teacher forcing (SamplingParams.forced_token_ids) and per-token log-probs run through its
real serving path; they are checked against transformers' own teacher-forced log-probs. Pairs that
differ only numerically come out identical or drift; a paged-KV fault on one side comes out
corruption, at the token where its greedy output really changed or before, localised to a layer and
a page by the shadow probe's dense recompute.
"""
import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, faults
from workbench.diverge import EngineSide, triage
from workbench.events import AttentionRead, KVWritten, StepFinished


def prompts(n=8, seed=3):
    rng = np.random.default_rng(seed)
    pre = rng.integers(3, 256, 40).tolist()
    return [pre + rng.integers(3, 256, int(k)).tolist() for k in rng.integers(3, 30, n)]


def engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 256, **kw}))


def test_forced_tokens_and_logprobs_through_the_serving_path_match_transformers(sharp_llama_dir, tiny_hf_model):
    eng = engine(sharp_llama_dir)
    rng = np.random.default_rng(0)
    ps = prompts(4)
    forced = [rng.integers(3, 256, 12).tolist() for _ in ps]
    outs = eng.generate(ps, [SamplingParams(max_tokens=12, logprobs=3, forced_token_ids=f, ignore_eos=True)
                             for f in forced])
    for p, f, o in zip(ps, forced, outs):
        assert o.token_ids == f and len(o.logprobs) == 12 and len(o.logprobs[0][1]) == 3
        with torch.no_grad():
            lp = torch.log_softmax(tiny_hf_model(torch.tensor([p + f])).logits[0, len(p) - 1:-1].float(), -1)
        want = lp[torch.arange(12), torch.tensor(f)].numpy()
        got = np.array([x[0] for x in o.logprobs])
        assert np.abs(got - want).max() < 1e-3, np.abs(got - want).max()
        assert [x[1][0] for x in o.logprobs] == lp.argmax(-1).tolist()         # the model's own top token
    with pytest.raises(ValueError, match="logprobs must be an int >= 0"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="forced_token_ids must be token ids"):
        SamplingParams(forced_token_ids=(1, -2))


@pytest.mark.parametrize("pair", ["page size 16 vs 64", "bf16 vs fp32", "batch 1 vs 8", "prefix cache warm vs cold",
                                  "ours vs transformers"])
def test_pairs_that_differ_only_numerically_are_drift_or_identical(sharp_llama_dir, pair):
    ps = prompts()
    a = engine(sharp_llama_dir)
    if pair == "page size 16 vs 64":
        b = engine(sharp_llama_dir, page_size=64, num_pages=64)
    elif pair == "bf16 vs fp32":
        b = engine(sharp_llama_dir, dtype="bfloat16")
    elif pair == "batch 1 vs 8":
        a, b = EngineSide(a, "batch 1", batch=1), EngineSide(engine(sharp_llama_dir), "batch 8", batch=8)
    elif pair == "prefix cache warm vs cold":
        b = engine(sharp_llama_dir)
        b.generate(ps, SamplingParams(max_tokens=4, ignore_eos=True))       # the shared prefix now cached
    else:
        b = str(sharp_llama_dir)                                             # transformers, float32, no cache
    rep = triage(a, b, ps, max_tokens=24)
    df = rep.frame()
    assert set(df.verdict) <= {"identical", "drift"}, (rep.summary(), df.evidence.tolist())
    if pair == "bf16 vs fp32":
        assert (df.verdict == "drift").all() and rep.scale > 1e-3               # bf16 really differs a little


@pytest.mark.parametrize("fault", ["stale_binding", "page_out_of_range"])
def test_a_paged_kv_fault_is_corruption_from_the_token_its_output_changed(sharp_llama_dir, fault):
    ps = prompts()
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    clean = [o.token_ids for o in engine(sharp_llama_dir).generate(ps, greedy)]
    bad_eng = engine(sharp_llama_dir)
    with faults.inject(bad_eng, fault):
        bad = [o.token_ids for o in bad_eng.generate(ps, greedy)]
    changed = [next((t for t, (x, y) in enumerate(zip(c, b)) if x != y), None) for c, b in zip(clean, bad)]
    assert any(c is not None for c in changed)                                # the output really changed
    b = engine(sharp_llama_dir)
    with faults.inject(b, fault):
        rep = triage(engine(sharp_llama_dir), b, ps, max_tokens=24)
    df = rep.frame()
    for i, c in enumerate(changed):
        if c is not None:
            # its first wrong token is found, and no later than where the greedy text changed
            assert df.verdict[i] == "corruption" and df.first_token[i] <= c, (i, c, df.evidence[i])
    assert rep.floor < 1e-3 and (df.verdict == "corruption").sum() >= sum(c is not None for c in changed)
    # the strip: a cell per token of every request, the corrupt ones marked
    fig = rep.strip()
    assert fig.data[0].z.shape == (len(ps), 24)
    assert len(fig.data[1].x) == sum(int(t["corrupt"].sum()) for t in rep.per_token) > 0
    # localised on the engine side: the shadow's dense recompute at that token names a layer and a page
    # (stale_binding: every run; page_out_of_range corrupts one step of a run, which a re-run need not meet)
    located = df[df.pages.notna()]
    assert len(located) >= (1 if fault == "stale_binding" else 0), df.evidence.tolist()
    for _, row in located.iterrows():
        assert row.pages and "shadow check there" in row.evidence
        if fault == "stale_binding":
            assert 0 <= row.layer < 2


def test_kvwb_diff_names_the_pair_and_exits_by_verdict(sharp_llama_dir, capsys):
    from workbench.cli import main
    assert main(["diff", f"engine:{sharp_llama_dir}", f"engine:{sharp_llama_dir}?page_size=64&num_pages=64",
                 "--limit", "3", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "A vs B: " in out and "request 2:" in out and " 0 corruption" in out.splitlines()[0]
    assert main(["diff", "engine?nope=1", "hf:x"]) == 2
    assert "'nope' is not an EngineConfig field" in capsys.readouterr().err
    # B forced through its prefill (prompt log-probs), and where the time went
    assert main(["diff", f"engine:{sharp_llama_dir}", f"engine:{sharp_llama_dir}?num_pages=64",
                 "--limit", "3", "--max-tokens", "8", "--forced", "prefill", "--time"]) == 0
    out = capsys.readouterr().out
    assert " 0 corruption" in out.splitlines()[0] and "time: A greedy" in out and "B teacher-forced" in out
    assert main(["diff", f"engine:{sharp_llama_dir}", f"hf:{sharp_llama_dir}", "--limit", "2", "--max-tokens", "4",
                 "--forced", "prefill"]) == 2
    assert "--forced prefill needs an engine side to force" in capsys.readouterr().err


@pytest.mark.parametrize("fault", [None, "stale_binding"])
def test_a_flight_recording_is_the_reference_side(sharp_llama_dir, tmp_path, fault):
    """Production recorded (clean, or with a fault it did not know about); the recording triaged
    against a clean engine teacher-forced on its tokens: identical when clean, corruption at the
    first recorded token that really differs from a clean run's."""
    ps = prompts()
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    clean = [o.token_ids for o in engine(sharp_llama_dir).generate(ps, greedy)]
    prod = engine(sharp_llama_dir, record_dir=str(tmp_path / "rec"))
    sampled = prod.add_request(ps[0], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    if fault:
        with faults.inject(prod, fault):
            recorded = [o.token_ids for o in prod.generate(ps, greedy)]
    else:
        recorded = [o.token_ids for o in prod.generate(ps, greedy)]
    prod.recorder.close()
    changed = [next((t for t, (x, y) in enumerate(zip(c, r)) if x != y), None) for c, r in zip(clean, recorded)]
    assert (fault is None) == all(c is None for c in changed)                  # the fault really changed outputs

    rep = triage(str(tmp_path / "rec"), engine(sharp_llama_dir))              # A, B in any order: the recording leads
    df = rep.frame()
    assert rep.a.startswith("recording") and len(df) == len(ps)
    assert sampled not in set(df.request)                                     # a sampled request is no evidence
    for i, c in enumerate(changed):
        if c is None:
            assert df.verdict[i] in ("identical", "drift"), df.evidence[i]
        else:
            assert df.verdict[i] == "corruption" and df.first_token[i] <= c, (i, c, df.evidence[i])
    if fault:
        assert (df.verdict == "corruption").sum() >= sum(c is not None for c in changed) > 0
    else:
        assert (df.verdict == "identical").all(), df.evidence.tolist()
    # the same recording from the command line, as a path
    from workbench.cli import main
    assert main(["diff", str(tmp_path / "rec"), f"engine:{sharp_llama_dir}"]) == (1 if fault else 0)


@pytest.mark.parametrize("case", ["stale_binding", "fp16_kv_overflow", "stale_binding vs transformers"])
def test_the_layer_curve_names_the_layer_the_corruption_enters(sharp_llama_dir, case):
    """A fault switched on in B: the corrupt request's hidden states and attention outputs, layer by layer
    against A's at its first bad token (our engine through a model tap, transformers through forward
    hooks), stay on their floor until the layer the fault corrupts. fp16_kv_overflow: the layer whose K/V
    it makes overflow (the middle of 2: 1). stale_binding: the first layer where the stale page holds
    other K/V than the right one (the prompts share a prefix: the same tokens at the same positions give
    the same layer-0 K/V, so a stale page can read right there); the shadow probe's dense recompute
    re-run to that token, an independent method, names the same layer."""
    fault = case.split()[0]
    kw = {"kv_cache_dtype": "float16"} if fault == "fp16_kv_overflow" else {}
    ps = prompts()
    a = str(sharp_llama_dir) if "transformers" in case else engine(sharp_llama_dir, **kw)
    b = engine(sharp_llama_dir, **kw)
    with faults.inject(b, fault) as f:
        rep = triage(a, b, ps, max_tokens=24, localize=2)
    df = rep.frame()
    assert (df.verdict == "corruption").any() and rep.curves, rep.summary()
    for i, curve in rep.curves.items():
        want = f.layer if fault == "fp16_kv_overflow" else rep.faults[i]["layer"]
        assert df.layer[i] == curve["layer"] == want, (i, want, curve)
        quiet = slice(0, want)
        assert (curve["at"][quiet] <= 10 * curve["floor"][quiet] + 1e-4).all()        # on its floor before
        assert "hidden states part at layer" in df.evidence[i]
    if fault == "fp16_kv_overflow":
        assert f.layer == 1 and all(df.layer[i] == 1 for i in rep.curves)
    i = next(iter(rep.curves))
    fig = rep.layer_curve(i)
    assert len(fig.data) == 2 and len(fig.data[0].y) == 2                          # at the token, and the floor
    if i in rep.faults:
        pm = rep.page_map(i)
        assert pm.data[0].z.shape[1] == 16 and np.nanmax(pm.data[0].z) > 0          # the positions at fault marked
        # one name per screen: the message, the page map and the table name the triage's request i, and
        # the engine's own id beside it, never the engine's id alone
        rid = rep.faults[i]["engine_request_id"]
        assert f"request {i} (engine request {rid})" in rep.faults[i]["message"]
        assert pm.layout.title.text.startswith(f"request {i} (engine request {rid})")
        assert f"request {i} (engine request {rid})" in df.evidence[i]


def test_a_localising_rerun_that_fails_leaves_no_probe_or_tap_behind(tiny_llama_dir):
    """forced_run attaches the shadow and page_table probes and a hidden-state tap; a prompt the engine
    rejects (longer than max_model_len) must take them all off again and leave nothing queued."""
    from workbench.diverge.localize import forced_run
    from workbench.engine.outputs import RequestRejected
    eng = engine(tiny_llama_dir, max_model_len=128)
    ok = prompts(2)
    with pytest.raises(RequestRejected):
        forced_run(eng, ok + [list(range(3, 200))], [[5, 6], [7, 8], [9, 10]], 0, [1])
    assert eng.model.hooks is None and eng.pool.observer is None and not eng.model_hooks.taps
    assert not any(eng.bus.wants(t) for t in (StepFinished, KVWritten, AttentionRead))     # no listener left
    assert not eng.has_unfinished()
    hidden, found = forced_run(eng, ok, [[5, 6], [7, 8]], 1, [0, 1])        # and the engine still serves it
    assert set(hidden) == {0, 1} and found is None
