"""shadow probe: a dense recompute of one sequence per check, against the paged path.

Clean runs (fp32, chunked prefill + prefix hits + preemption, fp16/bf16, fp16_scaled,
score()) stay silent. Each planted bug patches the real code path (not faults.inject) and
every test asserts both that the greedy output really changed against a clean engine and
that a shadow error names the right request, layer, position and page.
"""
import dataclasses

import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.engine.attention.torch_ref import TorchPagedAttention
from workbench.engine.batch import BatchBuilder
from workbench.events import BatchPacked

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PS = 16


def make_engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 64, **kw}))


def watched(eng, **params):
    wb = Workbench(eng, log=False).attach("shadow", shadow={"every": 1, **params})
    return wb, wb.probe("shadow")


def random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def run(eng, prompts, params=GREEDY):
    """Step eng until done: (token ids per prompt, request ids, per step {request id: pages})."""
    ids = [eng.add_request(p, params) for p in prompts]
    done, pages = {}, []
    snap = lambda e: pages.append({s.request_id: list(s.pages) for s in eng.last_batch.seqs})
    eng.bus.subscribe(BatchPacked, snap)
    try:
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
    finally:
        eng.bus.unsubscribe(snap)
    return [done[i] for i in ids], ids, pages


def loud(wb, severity="warn"):
    return [(f.kind, f.severity, f.message) for f in wb.findings_at_least(severity)]


def errors_for(wb, rid):
    return [f for f in wb.findings_at_least("error") if f.request_id == rid and f.probe == "shadow"]


def assert_clean(wb, probe):
    assert loud(wb) == []
    assert probe.checks > 0 and len(probe.frame()) == probe.checks
    df = probe.frame()
    assert (df["max_err_kv"] <= df["tolerance_drift"]).all() and (df["bad_layer"].isna()).all()


# ---- clean runs ----------------------------------------------------------------------
def test_clean_run_is_silent_and_checks_every_step(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng)
    run(eng, random_prompts((10, 20, 30)))
    assert_clean(wb, probe)
    assert probe.checks == probe.forwards == eng.step_count
    df = probe.frame()
    assert set(df["layer"]) == {0, 1} and df["request_id"].nunique() == 3      # rotates sequence and layer
    assert (df["max_err_out"] < 1e-4).all()                                   # fp32: float rounding only


def test_clean_run_with_sharing_preemption_and_chunking_is_silent(sharp_llama_dir):
    prefix = random_prompts([48], seed=5)[0]
    prompts = [prefix + p for p in random_prompts([5, 30, 70, 12, 40], seed=6)] + random_prompts([90], seed=7)
    eng = make_engine(sharp_llama_dir, num_pages=16, max_num_batched_tokens=64)
    wb, probe = watched(eng)
    run(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert_clean(wb, probe)
    df = probe.frame()
    assert ((df["ctx"] > df["rows"]) & (df["rows"] > 1)).any()                # checked chunks that read pages


@pytest.mark.parametrize("kw", [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "fp16_scaled"},
                                {"kv_cache_dtype": "float16"}])
def test_clean_low_precision_runs_are_silent(sharp_llama_dir, kw):
    eng = make_engine(sharp_llama_dir, max_num_batched_tokens=64, **kw)
    wb, probe = watched(eng)
    run(eng, random_prompts((10, 20, 90)), SamplingParams(max_tokens=16, ignore_eos=True))
    assert_clean(wb, probe)


def test_score_is_checked_too(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng)
    logits = eng.score(random_prompts((12, 40)))
    assert [x.shape[0] for x in logits] == [12, 40]
    assert probe.checks == 1 and probe.frame()["request_id"].iloc[0] < 0 and loud(wb) == []


def test_default_every_is_sampled_and_budget_bounds_the_work(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng, every=None, budget=64)
    run(eng, random_prompts((10, 20, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
    df = probe.frame()
    assert 1 <= probe.checks < probe.forwards / 4 and loud(wb) == []
    assert (df["ctx"] * (df["layer"] + 1) <= 64).all()
    with pytest.raises(ValueError):
        watched(make_engine(sharp_llama_dir), every=0)


def test_check_now_forces_a_check_of_that_request_and_layer(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng, every=10**6)
    ids = [eng.add_request(p, GREEDY) for p in random_prompts((10, 20, 30))]
    for _ in range(3):
        eng.step()
    assert probe.checks == 1                                  # the first forward only
    probe.check_now(request_id=ids[1], layer=1)
    eng.step()
    row = probe.frame().iloc[-1]
    assert probe.checks == 2 and (row["request_id"], row["layer"], row["rows"]) == (ids[1], 1, 1)
    assert row["ctx"] == 20 + 3 and loud(wb) == []          # step 4 decodes its position 22


def test_a_probe_bug_never_reaches_the_engine(sharp_llama_dir, monkeypatch):
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng)
    monkeypatch.setattr(probe, "_stored", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = eng.generate(random_prompts((10,)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
    assert {f.kind for f in probe.findings} == {"probe-error"} and "boom" in probe.findings[0].message


# ---- planted bugs -----------------------------------------------------------------------
def clean_run(path, prompts, **kw):
    eng = make_engine(path, **kw)
    wb, _ = watched(eng)
    out = run(eng, prompts)
    assert loud(wb) == []
    return out


def test_kv_write_into_the_wrong_slot_is_a_bad_write_naming_the_page(sharp_llama_dir, monkeypatch):
    prompts = random_prompts((10, 20, 30))
    clean, ids, _ = clean_run(sharp_llama_dir, prompts)
    eng = make_engine(sharp_llama_dir)
    wb, probe = watched(eng)
    target, pos = ids[1], 20 + 2                  # request 1's third generated token goes one page off
    cls = type(eng.attn)
    monkeypatch.setattr(eng.attn, "fuse_rope_write", False)    # the seam: every K/V write through write_kv
    orig = cls.write_kv
    n = eng.num_pages

    def write_kv(self, k, v, k_cache, v_cache, batch, plan=None):
        for i, s in enumerate(batch.seqs):
            if s.request_id == target and s.num_computed_tokens == pos and batch.query_lens_np[i] == 1:
                slots = batch.slot_mapping.clone()
                r = int(batch.cu_seqlens_q_np[i])
                slots[r] += PS if int(slots[r]) // PS + 1 < n else -PS
                batch = dataclasses.replace(batch, slot_mapping=slots)
        return orig(self, k, v, k_cache, v_cache, batch, plan)

    monkeypatch.setattr(cls, "write_kv", write_kv)
    bad, ids, pages = run(eng, prompts)
    assert bad[1] != clean[1]                                        # the symptom is real
    errs = [f for f in errors_for(wb, target) if f.kind == "shadow-kv-write"]
    assert errs, loud(wb)
    f = errs[0]
    page = pages[f.step - 1][target][pos // PS]
    assert (f.layer, f.page, f.evidence["position"], f.evidence["offset"]) == (0, page, pos, pos % PS)
    if "found_at_page" in f.evidence:                                # where the K/V really went
        assert f.evidence["found_at_page"] in (page + 1, page - 1) and f.evidence["found_at_offset"] == pos % PS
    assert "write" in f.hint and "slot_mapping" in f.hint


@pytest.mark.parametrize("scenario", ["chunk", "prefix-hit"])
def test_wrong_causal_mask_after_chunk_or_prefix_hit_is_a_bad_read(sharp_llama_dir, monkeypatch, scenario):
    # The mask of a prefill that reads pages lets each query see one future key.
    prefix = random_prompts([48], seed=3)[0]

    def scenario_run(eng):
        if scenario == "chunk":                   # a 150-token prompt in 64-token chunks, then a short one
            out, ids, pages = run(eng, random_prompts((150, 10), seed=1))
            return out[0], ids[0], pages, 64
        run(eng, [prefix + random_prompts([8], seed=8)[0]], SamplingParams(max_tokens=4, ignore_eos=True))
        out, ids, pages = run(eng, [prefix + random_prompts([24], seed=9)[0]])   # hits the 3 cached pages
        assert eng.stats()["prefix_cache_hits"] > 0
        return out[0], ids[0], pages, 48

    kw = {"max_num_batched_tokens": 64}
    eng = make_engine(sharp_llama_dir, **kw)
    wb, _ = watched(eng)
    clean, _, _, _ = scenario_run(eng)
    assert loud(wb) == []

    orig = TorchPagedAttention.plan

    def plan(self, batch, *a):
        p = orig(self, batch, *a)
        for s in p.prefill:
            if s.mask is not None:                # rebuilt, not shifted: the plan is shared by all layers
                n, c = s.end - s.start, s.context
                s.mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None] + 1
        return p

    monkeypatch.setattr(TorchPagedAttention, "plan", plan)
    eng = make_engine(sharp_llama_dir, **kw)
    wb, _ = watched(eng)
    bad, target, pages, first = scenario_run(eng)
    assert bad != clean
    errs = [f for f in errors_for(wb, target) if f.kind == "shadow-attention"]
    assert errs, loud(wb)
    f = errs[0]
    # The first row whose output moved beyond rounding (a query whose next key has weight ~0 does not).
    pos = f.evidence["position"]
    assert f.layer == 0 and f.evidence["query_start"] == first <= pos < first + 64
    assert f.page == pages[f.step - 1][target][pos // PS]
    assert f.evidence["matches"].startswith("causal mask shifted by +1") and f.evidence["reads_pages"]
    assert not [g for g in errors_for(wb, target) if g.kind == "shadow-kv-write" and g.step <= f.step]


def test_rope_position_slip_is_named(sharp_llama_dir, monkeypatch):
    # One request's decode rows run at position + 1: q and k rotated one position off.
    prompts = random_prompts((10, 20, 30))
    clean, ids, _ = clean_run(sharp_llama_dir, prompts)
    target = ids[2]
    orig = BatchBuilder.build

    def build(self, scheduled, *a, **kw):
        b = orig(self, scheduled, *a, **kw)
        for i, s in enumerate(b.seqs):
            if s.request_id == target and b.query_lens_np[i] == 1:
                b.positions[int(b.cu_seqlens_q_np[i])] += 1
        return b

    monkeypatch.setattr(BatchBuilder, "build", build)
    eng = make_engine(sharp_llama_dir)
    wb, _ = watched(eng)
    bad, ids, pages = run(eng, prompts)
    assert bad[2] != clean[2] and bad[0] == clean[0] and bad[1] == clean[1]
    errs = errors_for(wb, target)
    assert errs and all(f.request_id == target for f in wb.findings_at_least("error")), loud(wb)
    f = errs[0]
    assert f.kind == "shadow-rope" and f.layer == 0
    assert f.evidence["position"] == 30 and f.evidence["rotated_at_position"] == 31   # its first decode token
    assert f.page == pages[f.step - 1][target][30 // PS] and "positions" in f.hint


def test_decode_kernel_reading_another_rows_table_is_a_bad_read(sharp_llama_dir, monkeypatch):
    prompts = random_prompts((10, 20, 30))
    clean, ids, _ = clean_run(sharp_llama_dir, prompts)
    target = ids[1]
    cls = type(make_engine(sharp_llama_dir).attn)
    orig = cls.plan_decode

    def plan_decode(self, batch, rows_all, *a):
        rows = [i for i in rows_all.tolist() if batch.seqs[i].request_id == target]
        if rows and len(rows_all) > 1:            # its row of the table the kernel walks is another row's
            r = rows[0]
            other = next(i for i in rows_all.tolist() if i != r)
            bt = batch.block_tables.clone()
            bt[r] = bt[other]
            batch = dataclasses.replace(batch, block_tables=bt)
        return orig(self, batch, rows_all, *a)

    monkeypatch.setattr(cls, "plan_decode", plan_decode)
    eng = make_engine(sharp_llama_dir)
    wb, _ = watched(eng)
    bad, ids, pages = run(eng, prompts)
    assert bad[1] != clean[1] and bad[0] == clean[0] and bad[2] == clean[2]
    errs = errors_for(wb, target)
    assert errs and all(f.request_id == target for f in wb.findings_at_least("error")), loud(wb)
    f = errs[0]
    assert f.kind == "shadow-attention" and f.layer == 0 and f.evidence["rows"] == 1
    pos = 20 + f.step - 2                         # prefilled in step 1: step s decodes position 20 + s - 2
    assert f.evidence["position"] == pos and f.page == pages[f.step - 1][target][pos // PS]
    assert "block table" in f.hint
