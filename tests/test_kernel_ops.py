"""Issue 30: the compiled attention kernels as torch.library custom ops (engine/kernels/ops.py), checked by
torch.library.opcheck (schema with out's mutation declared, the fake implementation, autograd registration,
AOT dispatch) and against dense attention computed here from the pages."""
import math

import pytest
import torch

from workbench.engine.kernels import ATTENTION

pytestmark = pytest.mark.skipif(ATTENTION.get() is None, reason="no compiled attention kernels on this machine")


def gqa_attention(q, k, v, causal_from=None):
    """q [n, H, D], k / v [c, Hk, D]: float64 softmax attention; query j sees keys <= causal_from + j."""
    h, hk = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(h // hk, dim=1)
    v = v.double().repeat_interleave(h // hk, dim=1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) / math.sqrt(q.shape[-1])
    if causal_from is not None:
        allowed = torch.arange(k.shape[0])[None, :] <= causal_from + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v).float()


def decode_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps, npages, h, hk, d = 16, 40, 9, 3, 64
    lens = [5, 16, 33, 70]
    kc = torch.randn(npages, ps, hk, d, generator=g)
    vc = torch.randn(npages, ps, hk, d, generator=g)
    perm = torch.randperm(npages, generator=g)
    tables = torch.zeros(len(lens), 5, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // ps)
        tables[i, :k] = perm[used:used + k].to(torch.int32)
        used += k
    q = torch.randn(len(lens) + 2, h, d, generator=g)          # two rows that are not decode queries
    tok = torch.tensor([1, 2, 4, 5])
    rows = torch.arange(len(lens))
    return dict(q=q, out=torch.zeros_like(q), k_cache=kc, v_cache=vc, tables=tables, tok=tok, rows=rows,
                lens=torch.tensor(lens, dtype=torch.int32), scale=1 / math.sqrt(d)), lens, ps


def test_paged_decode_op_equals_dense_attention_over_the_pages():
    a, lens, ps = decode_case()
    torch.ops.pagedkv.paged_decode(**a)
    for i, n in enumerate(lens):
        pages = a["tables"][i, : -(-n // ps)].long()
        k = a["k_cache"][pages].reshape(-1, *a["k_cache"].shape[2:])[:n]
        v = a["v_cache"][pages].reshape(-1, *a["v_cache"].shape[2:])[:n]
        t = int(a["tok"][i])
        want = gqa_attention(a["q"][t:t + 1], k, v)
        assert torch.allclose(a["out"][t:t + 1], want, atol=2e-5, rtol=1e-4), i
    assert not a["out"][[0, 3]].any()                      # rows that are not decode queries are not written


def test_paged_decode_op_passes_opcheck():
    a, _, _ = decode_case(1)
    torch.library.opcheck(torch.ops.pagedkv.paged_decode.default, (), a)


def prefill_case(seed=2):
    g = torch.Generator().manual_seed(seed)
    n, h, hk, d = 23, 9, 3, 64
    q, k, v = (torch.randn(n, x, d, generator=g) for x in (h, hk, hk))
    cache = torch.zeros(4, 16, hk, d)
    # one chunk, no cached context: start 0, n rows, context n, its table row 0, fresh (no pages), mask offset 0
    chunks = torch.tensor([[0, n, n, 0, 1, 0]], dtype=torch.int64)
    return dict(q=q, out=torch.zeros_like(q), k=k, v=v, k_cache=cache, v_cache=cache.clone(),
                tables=torch.zeros(1, 1, dtype=torch.int32), chunks=chunks, scale=1 / math.sqrt(d), bf16_dots=False)


def test_paged_prefill_op_equals_causal_attention_and_passes_opcheck():
    a = prefill_case()
    torch.ops.pagedkv.paged_prefill(**a)
    want = gqa_attention(a["q"], a["k"], a["v"], causal_from=0)
    assert torch.allclose(a["out"], want, atol=2e-5, rtol=1e-4)
    torch.library.opcheck(torch.ops.pagedkv.paged_prefill.default, (), prefill_case(3))


def test_the_fake_kernel_traces_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode
    a, _, _ = decode_case()
    with FakeTensorMode() as mode:
        fa = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
        torch.ops.pagedkv.paged_decode(**fa)          # shapes only: the compiled kernel never sees fakes
