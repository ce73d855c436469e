"""The bfloat16 path on the CPU: greedy outputs within bf16 tolerance of the float32 reference.

On a CPU without native bf16 GEMMs (this machine: no avx512_bf16 / AMX) the engine keeps the
weights and KV pages in bf16 and computes in float32 ("storage", engine/cpu_bf16.py); with
PAGEDKV_BF16=native it computes in bf16 as it would on hardware that has it (emulated here:
slow, same contract). The tolerance is measured, not assumed: the teacher-forced logits error
of bf16 against fp32 on the reference's own tokens. A greedy run may leave the fp32 path only
where fp32 itself is within that error of a tie. Native bf16 hands the compiled kernels its bf16 rows
where they take them (avx512_bf16: prefill's bf16 dots), else computes attention in float32 between
its bf16 GEMMs (LlamaModel.attention_dtype): the compiled kernels, over the bf16 pages, either way.
"""
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine import cpu_bf16, skinny_gemm
from workbench.engine.attention import native
from workbench.engine.attention.cpu_paged import NativeDecode, prefill_bf16_dots
from workbench.engine.linear import NATIVE_BF16_SKINNY_ROWS, NATIVE_BF16_WIDENING_ROWS
from workbench.engine.weights import load_model

CHATS = [[{"role": "user", "content": c}] for c in (
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a page table is in one sentence.", "Say hello in Spanish.", "What is 12 times 7?",
    "Name a colour of the rainbow.", "Why is the sky blue? Answer briefly.")]
NEW = 32


@pytest.fixture(scope="module")
def fp32(smollm2_path):
    eng = Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=256))
    outs = eng.generate(CHATS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    return eng, [list(o.prompt_token_ids) + list(o.token_ids) for o in outs], [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def bf16_model(smollm2_path):
    return load_model(smollm2_path, torch.bfloat16)


def bf16_engine(loaded, mode, monkeypatch):
    monkeypatch.setenv("PAGEDKV_BF16", mode)
    return Engine(loaded, EngineConfig(num_pages=256, dtype="bfloat16"))


def check_within_tolerance(eng, fp32, n=len(CHATS)):
    ref, seqs, ref_tokens = fp32
    seqs, ref_tokens = seqs[:n], ref_tokens[:n]
    # What bf16 costs: the teacher-forced logits on fp32's own sequences.
    want = [w.float() for w in ref.score(seqs)]
    got = [g.float() for g in eng.score(seqs)]
    err = torch.cat([(g - w).abs().amax(-1) for g, w in zip(got, want)])
    scale = max(float(w.abs().max()) for w in want)
    assert float(err.max()) < 0.08 * scale, float(err.max())            # bf16-sized, not broken
    assert float(err.max()) > 0                                          # and really a bf16 model
    agree = torch.cat([(g.argmax(-1) == w.argmax(-1)).float() for g, w in zip(got, want)]).mean()
    assert float(agree) >= 0.9
    tol = float(err.max())
    outs = eng.generate(CHATS[:n], SamplingParams(max_tokens=NEW, ignore_eos=True))
    same = 0
    for i, o in enumerate(outs):
        toks = list(o.token_ids)
        if toks == ref_tokens[i]:
            same += 1
            continue
        j = next(t for t in range(NEW) if toks[t] != ref_tokens[i][t])
        # At the first divergence, fp32 itself is within the bf16 error of choosing bf16's token.
        plen = len(seqs[i]) - NEW
        row = want[i][plen - 1 + j]
        margin = float(row[ref_tokens[i][j]] - row[toks[j]])
        assert 0 <= margin <= 2 * tol, (i, j, margin, tol)
    # Which near-ties flip is chance (32 tokens a chat, 8 chats: 3 to 5 match exactly here); the
    # margin check above bounds every divergence. A quarter matching end to end rules out a model
    # that drifts everywhere.
    assert same >= max(1, n // 4), same
    return outs


def test_bf16_storage_mode_within_tolerance_of_fp32(bf16_model, fp32, monkeypatch):
    eng = bf16_engine(bf16_model, "storage", monkeypatch)
    m = eng.model
    assert m.weight_dtype == torch.bfloat16 and m.dtype == torch.float32      # bf16 weights, fp32 compute
    assert eng.kv.k[0].dtype == torch.bfloat16                                # bf16 KV pages
    lin = m.layers[0].gate
    if skinny_gemm.for_linears() is not None:
        assert lin.skinny is not None and lin.skinny.dtype == torch.bfloat16 and lin.weight is None
    else:                                  # a CPU without the compiled kernels: the bf16 weight, widened per call
        assert lin.skinny is None and lin.weight.dtype == torch.bfloat16 and lin.backend in ("torch", "onednn")
    assert lin.nbytes == lin.numel * 2                                         # stored once, in bf16
    check_within_tolerance(eng, fp32)
    plan = eng.last_batch.attn_plan
    compiled = native.kernel() is not None
    assert plan.decode and isinstance(plan.decode[0], NativeDecode) == compiled   # the kernel read bf16 pages
    eng.generate(CHATS[:1], SamplingParams(max_tokens=1))
    npf = eng.last_batch.attn_plan.native_prefill
    assert (npf is not None) == compiled and (npf is None or not npf.bf16_dots)   # storage: float32 arithmetic


def test_bf16_native_mode_within_tolerance_of_fp32(bf16_model, fp32, monkeypatch):
    eng = bf16_engine(bf16_model, "native", monkeypatch)
    assert eng.model.dtype == torch.bfloat16 and eng.kv.k[0].dtype == torch.bfloat16
    # emulated bf16 GEMMs (no avx512_bf16 / AMX) are slow: 4 chats, not 8
    check_within_tolerance(eng, fp32, n=len(CHATS) if cpu_bf16.hardware_native() else 4)
    plan = eng.last_batch.attn_plan
    if native.kernel() is None:            # a CPU without the compiled kernels: torch's attention, as a whole
        assert plan.decode and not isinstance(plan.decode[0], NativeDecode) and plan.native_prefill is None
        return
    assert plan.decode and isinstance(plan.decode[0], NativeDecode)
    # The compiled kernels take bf16 rows where the build and the CPU have avx512_bf16 (prefill's
    # scores and P.V in bf16 pairs: the outputs above were checked with them); elsewhere attention
    # runs in float32 between the bf16 GEMMs. The compiled prefill kernel either way.
    bf16_rows = prefill_bf16_dots()
    want = torch.bfloat16 if bf16_rows else torch.float32
    assert eng.model.attention_dtype(eng.attn, eng.kv.k[0]) == want
    eng.generate(CHATS[:1], SamplingParams(max_tokens=1))
    npf = eng.last_batch.attn_plan.native_prefill
    assert npf is not None and npf.bf16_dots == bf16_rows
    # A page_reader (a fault seam) takes the kernels out: float32 attention then, not torch's bf16 SDPA.
    attn = eng.attn
    attn.page_reader = lambda cache, pages, rows, dtype: attn.gather(cache, pages, rows, dtype)
    try:
        assert eng.model.attention_dtype(attn, eng.kv.k[0]) == torch.float32
        out = eng.generate(CHATS[:1], SamplingParams(max_tokens=2))[0]
        assert len(out.token_ids) == 2 and eng.last_batch.attn_plan.native_prefill is None
    finally:
        attn.page_reader = None


def test_native_bf16_small_rows_take_the_skinny_gemm_over_the_same_bf16_weights(bf16_model, monkeypatch):
    """Decode-sized inputs run the skinny GEMM: the bf16 pair kernel (vdpbf16ps) where it is compiled
    in, else the float32 one over the same bf16 weights; larger inputs oneDNN's bf16 GEMM (F.linear where
    oneDNN has none: an AVX2-only CPU)."""
    from conftest import require_compiled
    from workbench.engine.kernels import SKINNY_GEMM, trials
    require_compiled(SKINNY_GEMM, "the skinny GEMM")
    if skinny_gemm.for_linears() is None:
        pytest.skip("the skinny GEMM is a build of its portable loops here: the linears do not route to it")
    eng = bf16_engine(bf16_model, "native", monkeypatch)
    pairs = skinny_gemm.bf16_pairs()
    onednn = trials.onednn_linear(torch.bfloat16).ok      # no bf16 inner product on an AVX2-only CPU: F.linear
    for lin in (eng.model.layers[0].gate, eng.model.layers[0].down, eng.model.layers[0].qkv):
        assert lin.skinny is not None and lin.skinny.dtype == torch.bfloat16 and (lin.packed is not None) == onednn
        assert lin.pairs == pairs
        assert lin.skinny_rows == (NATIVE_BF16_SKINNY_ROWS if pairs else NATIVE_BF16_WIDENING_ROWS)
        if onednn:
            eye = torch.eye(lin.in_features, dtype=torch.bfloat16)                # oneDNN's copy, read back
            assert torch.equal(lin.dense_weight(),
                               torch.ops.mkldnn._linear_pointwise(eye, lin.packed, None, "none", [], "").T)
        else:                                                                     # F.linear above the skinny rows
            assert lin.weight is not None and lin.backend.endswith("+torch")
        ran = []
        skinny = lin._skinny
        monkeypatch.setattr(lin, "_skinny", lambda *a, f=skinny: ran.append(a[0].shape[0]) or f(*a))
        w = lin.dense_weight().float()
        g = torch.Generator().manual_seed(0)
        for rows in (1, 3, lin.skinny_rows, lin.skinny_rows + 1):
            x = torch.randn(rows, lin.in_features, generator=g).to(torch.bfloat16)
            other = torch.randn(rows, lin.out_features, generator=g).to(torch.bfloat16)
            for y, ref in ((lin.silu(x), torch.nn.functional.silu(x.float() @ w.T)),       # fp32 products
                           (lin.mul(x, other), (x.float() @ w.T) * other.float()),         # of the same values
                           (lin.add(x, other), (x.float() @ w.T) + other.float())):
                assert y.dtype == torch.bfloat16 and y.shape == (rows, lin.out_features)
                scale = float(ref.abs().max())
                assert float((y.float() - ref).abs().max()) <= 1e-2 * scale      # a bf16 rounding away
        assert ran == [1] * 3 + [3] * 3 + [lin.skinny_rows] * 3                  # larger: oneDNN's bf16 GEMM


def test_bf16_mode_follows_the_hardware_and_the_override(monkeypatch):
    monkeypatch.delenv("PAGEDKV_BF16", raising=False)
    native, why = cpu_bf16._native_auto()          # the flags, and oneDNN's bf16 linear passing its trial
    assert cpu_bf16.mode() == ("native" if native else "storage")
    assert why in cpu_bf16.describe()
    assert cpu_bf16.compute_dtype(torch.float32) == torch.float32
    monkeypatch.setenv("PAGEDKV_BF16", "storage")
    assert cpu_bf16.compute_dtype(torch.bfloat16) == torch.float32
    assert cpu_bf16.describe().startswith("storage")
    monkeypatch.setenv("PAGEDKV_BF16", "native")
    assert cpu_bf16.compute_dtype(torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv("PAGEDKV_BF16", "fast")
    with pytest.raises(ValueError, match="PAGEDKV_BF16='fast'"):
        cpu_bf16.mode()
