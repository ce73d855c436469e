"""probes/attention_math.py: the float32 reference and the explanations both attention checks use
(our engine's probe and the one inside vLLM's workers), each explanation shown to name the bug
that produced an output and to stay silent on a correct one."""
from __future__ import annotations

import pytest
import torch

from probes import attention_math as am
from workbench.adapters.vllm.kv_layout import layout_of

HQ, HKV, D, PS = 4, 2, 16, 8


def _case(ctx=40, rows=(20, 33, 39), seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(ctx, HKV, D, generator=g), torch.randn(ctx, HKV, D, generator=g)
    q = torch.randn(len(rows), HQ, D, generator=g) * 2
    return q, k, v, torch.tensor(rows), D ** -0.5


def _explain(got, q, k, v, pos, scale, **kw):
    heads = [int(h) for h in torch.nonzero(am.head_err(got, am.attend(q, k, v, am.causal(pos, len(k), **{
        x: kw[x] for x in ("window",) if x in kw}), scale)) > 1e-4).flatten()]
    return am.explain_read(q, got, k, v, pos, scale, 1e-4, heads=heads, page_size=PS,
                           pages=list(range(100, 100 + -(-len(k) // PS))), start=16, **kw)


def test_reference_is_dense_softmax_attention_with_gqa():
    q, k, v, pos, scale = _case()
    got = am.attend(q, k, v, am.causal(pos, len(k)), scale)
    for r, p in enumerate(pos.tolist()):
        for h in range(HQ):
            kh = h // (HQ // HKV)
            w = torch.softmax(k[: p + 1, kh] @ q[r, h] * scale, 0)
            assert torch.allclose(got[r, h], w @ v[: p + 1, kh], atol=1e-5)
    # the per-KV-head batched path and the explicit head map agree
    assert torch.allclose(got, am.attend(q, k, v, am.causal(pos, len(k)), scale, am.gqa_map(HQ, HKV)), atol=1e-6)


def test_window_and_softcap():
    q, k, v, pos, scale = _case()
    allowed = am.causal(pos, len(k), window=5)
    assert allowed.sum(-1).tolist() == [5, 5, 5] and bool(allowed[0, 16:21].all())
    got = am.attend(q, k, v, allowed, scale, softcap=3.0)
    p = int(pos[0])
    s = k[p - 4: p + 1, 0] @ q[0, 0] * scale
    w = torch.softmax(3.0 * torch.tanh(s / 3.0), 0)
    assert torch.allclose(got[0, 0], w @ v[p - 4: p + 1, 0], atol=1e-5)


def test_chunked_local_mask_reads_only_the_rows_own_chunk():
    """Llama 4's chunked-local attention: a row at position p reads keys of its own chunk up to p."""
    pos = torch.tensor([0, 7, 8, 13, 20])
    allowed = am.causal(pos, 21, chunk=8)
    assert [row.nonzero().flatten().tolist() for row in allowed] == \
        [[0], list(range(8)), [8], list(range(8, 14)), list(range(16, 21))]
    based = am.causal(pos[2:], 13, base=8, chunk=8)            # the same rows, keys read from position 8 on
    assert torch.equal(based, allowed[2:, 8:])
    # a mask shifted within the chunk is named, not taken for a bug of another kind
    q, k, v, _, scale = _case()
    p = torch.tensor([9, 14, 15])
    got = am.attend(q, k, v, am.causal(p, len(k), shift=-1, chunk=8), scale)
    said = am.mask_shift(q, got, k, v, p, scale, 1e-4, chunk=8)
    assert said is not None and "shifted by -1" in said[0], said


@pytest.mark.parametrize("bug, kind, words", [
    ("mask_ahead", "mask", "shifted by +1"),
    ("mask_behind", "mask", "shifted by -1"),
    ("scale", "scale", "1/head_dim"),
    ("kv_head", "kv-head-map", "2->0 (want 1)"),
    ("skip_page", "page-skipped", "page index 2 (page 102) left out"),
    ("repeat_page", "page-substituted", "page index 1 (page 101) from the slots of page index 0 (page 100)"),
])
def test_each_explanation_names_the_bug_that_made_the_output(bug, kind, words):
    q, k, v, pos, scale = _case()
    ctx = len(k)
    allowed = am.causal(pos, ctx)
    if bug == "mask_ahead":
        got = am.attend(q, k, v, am.causal(pos, ctx, shift=1), scale)
    elif bug == "mask_behind":
        got = am.attend(q, k, v, am.causal(pos, ctx, shift=-1), scale)
    elif bug == "scale":
        got = am.attend(q, k, v, allowed, 1.0 / D)
    elif bug == "kv_head":
        m = am.gqa_map(HQ, HKV)
        m[2] = 0
        got = am.attend(q, k, v, allowed, scale, m)
    elif bug == "skip_page":
        keys = torch.arange(ctx)[None]
        got = am.attend(q, k, v, allowed & ~((keys >= 16) & (keys < 24)), scale)
    else:
        k2, v2 = k.clone(), v.clone()
        k2[8:16], v2[8:16] = k[0:8], v[0:8]
        got = am.attend(q, k2, v2, allowed, scale)
    found = _explain(got, q, k, v, pos, scale)
    assert found is not None and found[0] == kind and words in found[1], found


def test_no_explanation_for_a_right_or_unrelated_output():
    q, k, v, pos, scale = _case()
    right = am.attend(q, k, v, am.causal(pos, len(k)), scale)
    assert am.rel_rows(right, am.attend(q, k, v, am.causal(pos, len(k)), scale)).max() == 0
    noise = right + torch.randn(right.shape, generator=torch.Generator().manual_seed(1))
    assert _explain(noise, q, k, v, pos, scale) is None


def test_a_backend_whose_cache_layout_is_unknown_is_named_not_read():
    class TritonAttentionImpl:
        kv_cache_dtype = "auto"

    class CPUAttentionBackendImpl:
        kv_cache_dtype = "auto"

    class Fp8(CPUAttentionBackendImpl):
        kv_cache_dtype = "fp8_e4m3"

    assert layout_of(TritonAttentionImpl()) == (None, "TritonAttentionImpl: its KV cache layout is not known to "
                                                      "the plugin")
    assert layout_of(CPUAttentionBackendImpl()) == ("cpu", "")
    assert layout_of(Fp8())[0] is None and "fp8" in layout_of(Fp8())[1]
