"""The attention check (probes/attention_check.py): every forward, one layer and one request row.

A suite of ordinary math bugs, each planted by patching the real code path of the torch attention
backend or the batch builder (no fault catalogue entry), each run under 20 seeds (the probe's
rotation and the workload both move): every one must be caught at `error` within 64 steps of its
first effect, naming a request and a row of the kind the bug touched, with the nearest explanation;
and the same workloads without a bug are silent. The tests' sharp tiny Llama (its outputs depend on
what attention reads) keeps 20 seeds cheap; SmolLM2 runs clean, and with one bug, once.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.engine.attention.torch_ref import TorchPagedAttention
from workbench.engine.batch import BatchBuilder

PS = 16
SEEDS = range(20)
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 96, "page_size": PS, "attention_backend": "torch",
                                                        "max_num_batched_tokens": 64, **kw}))


def workload(eng, seed, steps=120, until=None):
    """Six requests of 20-90 tokens, one added every 3 steps (prefill chunks beside decodes);
    until(): stop once it is true (a finding is in: the rest of the run would only cost time)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(20, 90, 6)]
    outs, ids = {}, []
    for step in range(steps):
        if prompts and step % 3 == 0:
            ids.append(eng.add_request(prompts.pop(0), PARAMS))
        if (not eng.has_unfinished() and not prompts) or (until is not None and until()):
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return [outs.get(i) for i in ids]


def watched(eng, seed):
    wb = Workbench(eng, log=False).attach("attention", attention={"seed": seed})
    return wb, wb.probe("attention")


# ---- the bugs: each patches a real code path and notes the steps it changed something ----------
def mask_ahead_in_prefill(eng, mp, fired):
    """A prefill's causal mask lets each query see the next key (whole prompts and chunks)."""
    def prefill(self, q, k, v, k_cache, v_cache, seqs, out):
        for s in seqs:
            n, c = s.end - s.start, s.context
            allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None] + 1
            if s.pages is None:
                ks, vs = k[s.start:s.end], v[s.start:s.end]
            else:
                ks = self.read_pages(k_cache, s.pages, 1, q.dtype)[0, :c]
                vs = self.read_pages(v_cache, s.pages, 1, q.dtype)[0, :c]
            o = F.scaled_dot_product_attention(q[s.start:s.end].transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None], attn_mask=allowed, scale=self.scale,
                                               enable_gqa=True)
            out[s.start:s.end] = o[0].transpose(0, 1)
            fired.append(eng.step_count)
    mp.setattr(TorchPagedAttention, "prefill", prefill)
    return {"chunk", "prefill"}, "mask"


def _decode_masked(mp, eng, fired, keep):
    """plan_decode whose key mask is keep(mask [Bd, 1, 1, W*ps], lens [Bd], ps) (the planned one otherwise)."""
    orig = TorchPagedAttention.plan_decode

    def plan_decode(self, batch, rows_all, *a):
        groups, pages_read = orig(self, batch, rows_all, *a)
        out = []
        for g in groups:
            rows = batch.cu_seqlens_q_np.searchsorted(g.tok.numpy(), side="right") - 1
            lens = torch.from_numpy(batch.context_lens_np[rows].astype(np.int64))
            base = torch.arange(g.width * batch.page_size)[None, :] < lens[:, None]
            mask = keep(base, lens, batch.page_size)
            if not torch.equal(mask, base):
                fired.append(eng.step_count)
            out.append(dataclasses.replace(g, mask=mask[:, None, None, :]))
        return out, pages_read
    mp.setattr(TorchPagedAttention, "plan_decode", plan_decode)


def mask_behind_in_decode(eng, mp, fired):
    """A decode row misses its own (newest) key."""
    _decode_masked(mp, eng, fired, lambda base, lens, ps: base & (torch.arange(base.shape[1])[None, :] < lens[:, None] - 1))
    return {"decode"}, "mask"


def page_walk_skips_a_page(eng, mp, fired):
    """The decode kernel's page walk skips page index 1 of a context of 3 pages or more."""
    def keep(base, lens, ps):
        key = torch.arange(base.shape[1])[None, :]
        skip = ((key >= ps) & (key < 2 * ps)) & (lens[:, None] > 2 * ps)
        return base & ~skip
    _decode_masked(mp, eng, fired, keep)
    return {"decode"}, "page-skipped"


def kv_heads_permuted_at_the_write(eng, mp, fired):
    """K's heads stored in another order (rolled by one)."""
    mp.setattr(eng.attn, "fuse_rope_write", False)
    orig = TorchPagedAttention.write_kv

    def write_kv(self, k, v, k_cache, v_cache, batch, plan=None):
        fired.append(eng.step_count)
        return orig(self, k.roll(1, dims=1), v, k_cache, v_cache, batch, plan)
    mp.setattr(TorchPagedAttention, "write_kv", write_kv)
    return {"decode", "chunk", "prefill"}, "write"


def gqa_map_slip_in_decode(eng, mp, fired):
    """Decode maps query head h to KV head h % Hkv instead of h // group (prefill is right)."""
    def decode(self, q, k_cache, v_cache, groups, out):
        hkv, d, hq = self.num_kv_heads, self.head_dim, self.num_heads
        g = hq // hkv
        for grp in groups:
            kd = self.read_pages(k_cache, grp.pages, grp.num_rows, q.dtype).transpose(1, 2)
            vd = self.read_pages(v_cache, grp.pages, grp.num_rows, q.dtype).transpose(1, 2)
            qd = q.index_select(0, grp.tok).view(grp.num_rows, g, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask, scale=self.scale)
            out.index_copy_(0, grp.tok, o.transpose(1, 2).reshape(grp.num_rows, hq, d))
            fired.append(eng.step_count)
    mp.setattr(TorchPagedAttention, "decode", decode)
    return {"decode"}, "kv-head-map"


def scale_off(eng, mp, fired):
    """The kernel's softmax scale is 1/head_dim, not head_dim^-1/2."""
    mp.setattr(eng.attn, "scale", 1.0 / eng.model_config.head_dim)
    fired.append(0)
    return {"decode", "chunk", "prefill"}, "scale"


def rope_slip_in_decode(eng, mp, fired):
    """Decode rows rotated at position + 1 (q and k alike: stored and read consistently)."""
    orig = BatchBuilder.build

    def build(self, scheduled, *a, **kw):
        b = orig(self, scheduled, *a, **kw)
        dec = np.nonzero(b.query_lens_np == 1)[0]
        if len(dec):
            b.positions[torch.from_numpy(b.cu_seqlens_q_np[dec].astype(np.int64))] += 1
            fired.append(eng.step_count)
        return b
    mp.setattr(BatchBuilder, "build", build)
    return {"decode"}, "rope"


BUGS = [mask_ahead_in_prefill, mask_behind_in_decode, page_walk_skips_a_page, kv_heads_permuted_at_the_write,
        gqa_map_slip_in_decode, scale_off, rope_slip_in_decode]
KIND_OF = {"write": "attention-write", "rope": "attention-rope"}


def test_clean_runs_are_silent_under_every_seed(sharp_llama_dir):
    for seed in SEEDS:
        eng = engine(sharp_llama_dir)
        wb, probe = watched(eng, seed)
        workload(eng, seed)
        assert not wb.findings_at_least("warn"), (seed, [f.message for f in wb.findings_at_least("info")])
        df = probe.frame()
        assert probe.checks == probe.forwards == len(df) > 20                      # one check every forward
        assert set(df["kind"]) == {"decode", "chunk", "prefill"} and df["layer"].nunique() == 2
        assert (df[["err_write", "err_read"]].max(axis=1) <= df["tolerance"]).all()
        assert (df["err_rope"] <= df["tolerance_rope"]).all()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_the_clean_path_computes_the_torch_checks_errors(sharp_llama_dir, monkeypatch, path):
    # every check computed both ways on the same inputs: the clean path's errors (what a clean check
    # records; compiled C, or numpy where the module does not apply) are the torch check's within float32
    # rounding, and on a clean run the torch check never runs
    from probes import attention_native
    from probes.attention_check import AttentionCheckProbe
    if path == "numpy":
        monkeypatch.setattr(attention_native, "module", lambda cache, dtype: None)
    else:
        from conftest import require_compiled
        require_compiled(attention_native.CHECK, "the compiled attention check")
    pairs, torch_runs = [], []
    clean, full = AttentionCheckProbe._clean_errors, AttentionCheckProbe._check_torch

    def both(self, p, tol):
        q = dict(p)
        got = clean(self, p, tol)
        pairs.append((got, full(self, q, tol)[0]))
        return got

    def counted(self, p, tol):
        torch_runs.append(p["step"])
        return full(self, p, tol)
    monkeypatch.setattr(AttentionCheckProbe, "_clean_errors", both)
    monkeypatch.setattr(AttentionCheckProbe, "_check_torch", counted)
    eng = engine(sharp_llama_dir)
    wb, probe = watched(eng, 3)
    workload(eng, 3)
    assert not wb.findings_at_least("warn") and not torch_runs and len(pairs) == probe.checks > 20
    kinds = set()
    for got, want in pairs:
        assert got is not None and set(got) == set(want)
        for k in got:
            # the C loops sum in another order than torch's GEMMs: on the sharp Llama's large scores that is
            # ~2e-6 of max through exp, still 50x under float32's tolerance (1e-4)
            assert abs(got[k] - want[k]) <= (1e-6 if path == "numpy" else 1e-5) + 1e-3 * abs(want[k]), (k, got, want)
        kinds |= set(got)
    assert kinds == {"write", "rope", "read"}


def test_the_compiled_check_is_tried_against_numpy_and_a_wrong_one_refused():
    from conftest import require_compiled
    from probes import attention_native
    mod = require_compiled(attention_native.CHECK, "the compiled attention check")
    attention_native.trial(mod)                     # what the loader ran once: it passes on the real module

    class Blind:                                    # the module, but blind to a slot written wrong
        rms_norm, rope = mod.rms_norm, mod.rope

        @staticmethod
        def check(*a):
            return 0.0, mod.check(*a)[1]
    with pytest.raises(AssertionError, match="a slot written wrong"):
        attention_native.trial(Blind)

    class NoNaN(Blind):                             # a NaN in the output read as clean
        @staticmethod
        def check(*a):
            w, r = mod.check(*a)
            return w, 0.0 if r != r else r
    with pytest.raises(AssertionError, match="NaN"):
        attention_native.trial(NoNaN)


def test_the_compiled_check_reads_a_page_list_or_array_alike_and_refuses_a_bad_page():
    """The sequence's own page list is read in C (no array made per check): the same errors as from an
    int64 array; a page outside the cache is an IndexError naming it, a non-int a TypeError; nothing read."""
    from conftest import require_compiled
    from probes import attention_native
    mod = require_compiled(attention_native.CHECK, "the compiled attention check")
    rng = np.random.default_rng(3)
    kc = torch.from_numpy(rng.standard_normal((6, 4, 2, 8), dtype=np.float32))
    vc = torch.from_numpy(rng.standard_normal((6, 4, 2, 8), dtype=np.float32))
    pages, ctx = [4, 1, 3], 10
    kn = kc.numpy()[pages].reshape(-1, 2, 8)[ctx - 1:ctx].copy()
    vn = vc.numpy()[pages].reshape(-1, 2, 8)[ctx - 1:ctx].copy() + 0.5          # a wrong V write
    q = rng.standard_normal((1, 4, 8), dtype=np.float32)
    o = q.copy()
    pos = np.array([ctx - 1])
    views = attention_native.CacheViews()
    k_np, v_np = views.get(kc, vc, 0)
    assert views.get(kc, vc, 0)[0] is k_np                                       # made once per layer
    by_list = attention_native.check(mod, k_np, v_np, pages, ctx, ctx - 1, kn, vn, q, o, pos, 0.35)
    by_array = attention_native.check(mod, kc, vc, np.array(pages), ctx, ctx - 1, kn, vn, q, o, pos, 0.35)
    assert by_list == by_array and by_list[0] > 0.05 and by_list[1] > 0
    with pytest.raises(IndexError, match="page 6 .index 1"):
        attention_native.check(mod, k_np, v_np, [4, 6, 3], ctx, ctx - 1, kn, vn, q, o, pos, 0.35)
    with pytest.raises(TypeError):
        attention_native.check(mod, k_np, v_np, [4, "1", 3], ctx, ctx - 1, kn, vn, q, o, pos, 0.35)
    with pytest.raises(ValueError, match="do not agree"):                      # a page list too short
        attention_native.check(mod, k_np, v_np, [4, 1], ctx, ctx - 1, kn, vn, q, o, pos, 0.35)


@pytest.mark.parametrize("setting, why", [("PAGEDKV_PROBE_KERNELS=numpy", "PAGEDKV_PROBE_KERNELS=numpy"),
                                          ("PAGEDKV_CPU_FEATURES=none", "fakes a CPU that runs no compiled code")])
def test_the_probes_compiled_paths_stay_unloaded_where_switched_off(setting, why):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    env.update([setting.split("=")])
    done = subprocess.run([sys.executable, "-c", "from probes.compiled import kernels; "
                           "[print(k.get() is None, k.why()) for k in kernels()]"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()            # the attention check's, page_table's, the ledger's, packing's
    assert len(lines) == 4 and all(ln.startswith("True") and why in ln for ln in lines), done.stdout


@pytest.mark.parametrize("bug", [rope_slip_in_decode, page_walk_skips_a_page], ids=lambda b: b.__name__)
def test_the_numpy_clean_path_still_catches_bugs(sharp_llama_dir, monkeypatch, bug):
    # the fallback (no compiler, PAGEDKV_PROBE_KERNELS=numpy, a bf16 cache) sends a bad check to torch too
    from probes import attention_native
    monkeypatch.setattr(attention_native, "module", lambda cache, dtype: None)
    for seed in (0, 1, 2):
        eng = engine(sharp_llama_dir)
        wb, probe = watched(eng, seed)
        fired: list = []
        with pytest.MonkeyPatch.context() as mp:
            bug(eng, mp, fired)
            workload(eng, seed, until=lambda: any(f.probe == "attention" for f in wb.findings_at_least("error")))
        f = next(f for f in wb.findings_at_least("error") if f.probe == "attention")
        assert fired and f.step - max(1, min(fired)) <= 64 and f.request_id is not None, (seed, f.message)


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.__name__)
def test_each_math_bug_is_caught_within_64_steps_under_every_seed(sharp_llama_dir, bug):
    clean = {}
    for seed in (0, 1):
        eng = engine(sharp_llama_dir)
        clean[seed] = workload(eng, seed)
    for seed in SEEDS:
        eng = engine(sharp_llama_dir)
        wb, probe = watched(eng, seed)
        fired: list = []
        with pytest.MonkeyPatch.context() as mp:
            kinds, explained = bug(eng, mp, fired)
            caught = lambda: any(f.probe == "attention" for f in wb.findings_at_least("error"))
            out = workload(eng, seed, until=None if seed in clean else caught)
        if seed in clean:
            assert out != clean[seed], f"{bug.__name__}: the planted bug changed no output (seed {seed})"
        assert fired, f"{bug.__name__} never fired (seed {seed})"
        errs = [f for f in wb.findings_at_least("error") if f.probe == "attention"]
        assert errs, (bug.__name__, seed, [f.message for f in wb.findings_at_least("info")])
        f = errs[0]
        assert f.step - max(1, min(fired)) <= 64, (bug.__name__, seed, f.step, min(fired))
        assert f.evidence["row_kind"] in kinds, (bug.__name__, seed, f.message)
        assert f.request_id is not None and 0 <= f.layer < eng.model_config.num_layers and f.page is not None
        seq_pages = f.evidence["page_index"]
        assert seq_pages == f.evidence["position"] // PS
        if explained in KIND_OF:
            assert f.kind == KIND_OF[explained], (bug.__name__, seed, f.message)
        else:
            assert f.kind == "attention-read" and f.evidence.get("explanation") == explained, \
                (bug.__name__, seed, f.message)
        if bug is rope_slip_in_decode:
            assert f.evidence["rotated_at_position"] == f.evidence["position"] + 1
        if bug is kv_heads_permuted_at_the_write:
            assert f.evidence["heads_hold"] == {0: 1, 1: 0}


def test_smollm2_clean_then_a_gqa_slip_named(smollm2_path, monkeypatch):
    eng = Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=128, max_num_batched_tokens=64))
    wb, probe = watched(eng, 0)
    workload(eng, 0, steps=40)
    assert not wb.findings_at_least("warn"), [f.message for f in wb.findings_at_least("info")]
    assert probe.checks == probe.forwards and probe.frame()["layer"].nunique() > 20
    eng = engine(smollm2_path, num_pages=128)
    wb, probe = watched(eng, 0)
    fired: list = []
    gqa_map_slip_in_decode(eng, monkeypatch, fired)
    workload(eng, 0, steps=40)
    (f, *_) = [f for f in wb.findings_at_least("error") if f.probe == "attention"]
    assert f.evidence["row_kind"] == "decode" and f.evidence["explanation"] == "kv-head-map", f.message
    assert f.step - min(fired) <= 64 and "query head -> KV head" in f.message


def test_a_probe_bug_never_reaches_the_engine(sharp_llama_dir, monkeypatch):
    eng = engine(sharp_llama_dir)
    wb, probe = watched(eng, 0)
    monkeypatch.setattr(probe, "_clean_errors", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    out = workload(eng, 0)
    assert all(o is not None for o in out)
    assert [f.kind for f in probe.findings] == ["probe-error"] and "boom" in probe.findings[0].message


def test_a_stale_block_table_is_explained_and_pictured(smollm2_path):
    # the catalogue's stale_binding (the kernel reads the previous step's block table): the attention
    # check sees the wrong output from the math alone and explains it by the pages the table named
    from workbench import faults
    from workbench.lab import QUESTIONS, chat
    eng = Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=64))
    wb = Workbench(eng, log=False).attach("attention")
    probe = wb.probe("attention")
    with faults.inject(eng, "stale_binding"):
        eng.generate(chat(QUESTIONS), SamplingParams(max_tokens=24, temperature=0.0))
    reads = [f for f in wb.findings_at_least("error") if f.kind == "attention-read"]
    assert reads, [f.message for f in wb.findings_at_least("info")]
    f = next((f for f in reads if f.evidence.get("explanation") == "block-table"), None)
    assert f is not None, [g.message for g in reads]
    assert "instead of the request's own (index" in f.message and f.evidence["row_kind"] in ("decode", "chunk")
    fig = probe.figure(f)
    names = {t.name for t in fig.data}
    assert names == {"want: the model's attention", "got: what reproduces the kernel's output"}
    want, got = fig.data[0].y, fig.data[1].y
    assert abs(sum(want) - 1) < 1e-4 and abs(sum(got) - 1) < 1e-4 and max(abs(a - b) for a, b in zip(want, got)) > 1e-3
    with pytest.raises(KeyError, match="no picture"):
        probe.figure(dataclasses.replace(f, layer=-1))
    # the finding carries the same picture (the schema the vLLM plugin's findings carry), and the
    # findings table draws it under the finding's details when its row is picked
    import plotly.graph_objects as go
    from workbench.findings import Finding, findings_frame
    from workbench.widgets import FindingsTable
    assert f.evidence["picture"] is probe.pictures[(f.kind, f.request_id, f.layer)]
    plain = Finding("page_table", "warn", "a finding without a picture", kind="other")
    table = FindingsTable(findings_frame(wb.findings_at_least("info") + [plain]))
    i = next(i for i, r in enumerate(table.rows()) if r["kind"] == f.kind and r["request_id"] == f.request_id
             and r["layer"] == f.layer and (r["evidence"] or {}).get("picture"))
    table.select(i)
    (shown,) = table.picture.children
    assert isinstance(shown, go.FigureWidget) and {t.name for t in shown.data} == names
    assert "picture" not in table.detail.value and "explanation" in table.detail.value
    table.select(next(j for j, r in enumerate(table.rows()) if r["kind"] == "other"))
    assert table.picture.children == ()


@pytest.mark.parametrize("n", [1, 8, 9, 37, 64, 100, 2048])
def test_the_rows_of_a_chunk_rotate_so_every_row_is_checked(n):
    from probes.attention_check import AttentionCheckProbe
    probe = AttentionCheckProbe(max_rows=8)
    step = max(1, -(-(n - 2) // 6))
    seen = set()
    for f in range(step):                       # that many checks of an n-row chunk meet every row
        rows = probe._rows(n, f)
        assert len(rows) <= 8 and rows[0] == 0 and rows[-1] == n - 1 and (rows < n).all()
        seen |= set(rows.tolist())
    assert seen == set(range(n))
