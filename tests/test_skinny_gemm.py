"""The skinny GEMM (decode-sized linears) and the decode kernel's bf16 pages, against torch.

References are computed independently: F.linear in float64 on the same (bf16-rounded) weights,
and dense float64 attention over the same (bf16-rounded) K/V.
"""
import numpy as np
import pytest

from workbench.engine.kernels import trials
import torch
import torch.nn.functional as F

from workbench.engine.attention import native
from workbench.engine.linear import SKINNY_MAX_ROWS, Linear


@pytest.fixture(scope="module")
def kernel(skinny_kernel):
    return skinny_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(832, 576), (40, 33), (17, 64), (1, 5)])
def test_skinny_gemm_matches_linear_with_every_epilogue(kernel, dtype, n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    wp = kernel.pack(w)
    assert torch.equal(kernel.unpack_float(wp, n), w.float())              # the layout round-trips
    for m in (1, 5, 7, 8, 9, 24, 48):                                      # tiles of 8, their tails
        x = torch.randn(m, k, generator=g)
        other = torch.randn(m, n, generator=g)
        ref = F.linear(x.double(), w.double(), b.double())
        cases = {(0, 0): ref, (1, 0): F.silu(ref), (0, 1): ref * other.double(), (0, 2): ref + other.double(),
                 (1, 1): F.silu(ref) * other.double()}
        for (act, op), want in cases.items():
            got = kernel.gemm(x, wp, n, b, act, other if op else None, op)
            assert got.shape == (m, n)
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-4 * max(1.0, want.abs().max().item()), (m, act, op, err)



@pytest.mark.parametrize("n,k", [(832, 576), (40, 34), (17, 64), (1, 6)])
def test_bf16_pair_kernel_matches_float64_on_the_same_bf16_values(kernel, n, k):
    """gemm_bf (native bf16: vdpbf16ps, float32 sums, one rounding to bf16 at the end) against
    float64 over the same bf16 activations, weights and `other`."""
    from workbench.engine import skinny_gemm
    if not skinny_gemm.bf16_pairs():
        pytest.skip("no avx512_bf16 in this build or CPU (the pair kernel is compiled out or unusable)")
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    wd = kernel.pack_pairs(w)
    assert wd.shape == (-(-n // 16), k // 2, 16, 2)
    assert torch.equal(wd.permute(0, 2, 1, 3).reshape(-1, k)[:n], w)       # the layout round-trips
    for m in (1, 5, 11, 12, 13, 16, 24, 25, 65):                           # even tiles of <= 12, their tails
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        other = torch.randn(m, n, generator=g).to(torch.bfloat16)
        ref = F.linear(x.double(), w.double(), b.double())
        cases = {(0, 0): ref, (1, 0): F.silu(ref), (0, 1): ref * other.double(), (0, 2): ref + other.double(),
                 (1, 1): F.silu(ref) * other.double()}
        for (act, op), want in cases.items():
            got = kernel.gemm_bf(x, wd, n, b, act, other if op else None, op)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            err = (got.double() - want).abs()
            # one bf16 rounding of the float32 result (2^-8 relative), plus float32 sums
            assert (err <= want.abs() * 2 ** -8 + 1e-4 * max(1.0, want.abs().max().item())).all(), (m, act, op)
    with pytest.raises(RuntimeError, match="K even"):
        kernel.pack_pairs(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        kernel.gemm_bf(torch.zeros(2, k), wd, n, None, 0, None, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.gemm_bf(torch.zeros(2, k + 2, dtype=torch.bfloat16), wd, n, None, 0, None, 0)

def test_skinny_gemm_rejects_bad_shapes(kernel):
    wp = kernel.pack(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.gemm(torch.randn(3, 17), wp, 32, None, 0, None, 0)           # K disagrees
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.gemm(torch.randn(3, 16), wp, 64, None, 0, None, 0)           # N past the blocks
    with pytest.raises(RuntimeError, match="other"):
        kernel.gemm(torch.randn(3, 16), wp, 32, None, 0, None, 1)           # mul without `other`


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_routes_by_rows_and_agrees_across_the_switch(kernel, dtype):
    """Decode sizes take the skinny GEMM, larger inputs oneDNN (fp32) or widened weights (bf16
    storage): both sides of the switch give the same product."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).to(dtype)
    lin = Linear(w, compute_dtype=torch.float32)
    if trials.skinny_vectorised(kernel).ok:
        assert lin.skinny is not None and lin.skinny.dtype == dtype
        if dtype == torch.bfloat16:
            assert lin.weight is None and lin.packed is None                # stored once, in bf16
    else:                                # a portable build (an AVX2-only CPU): the linears never route to it
        assert lin.skinny is None and not lin.backend.startswith("skinny")
        assert "portable loops" in trials.skinny_vectorised(kernel).why
    assert torch.equal(lin.dense_weight(), w)
    cut = SKINNY_MAX_ROWS[dtype]
    x = torch.randn(cut + 1, 64, generator=g)
    res = torch.randn(cut + 1, 96, generator=g)
    ref = F.linear(x.double(), w.double())
    for rows in (cut, cut + 1):                                             # the last skinny size, the first above
        assert (lin(x[:rows]).double() - ref[:rows]).abs().max() < 1e-4
        assert (lin.add(x[:rows], res[:rows]).double() - (ref[:rows] + res[:rows].double())).abs().max() < 1e-4
        assert (lin.silu(x[:rows]).double() - F.silu(ref[:rows])).abs().max() < 1e-4


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 4, 2), (64, 8, 1), (32, 6, 2)])
def test_decode_kernel_reads_bf16_pages(d, hq, hkv):
    """The compiled decode over bf16 pages equals dense float64 attention over the same bf16
    values (the 512-bit paths for d = 64 / 128, the generic one for d = 32; G > 4 in chunks)."""
    k = native.kernel()
    if k is None:
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(d + hq)
    P, ps = 48, 16
    kc = torch.randn(P, ps, hkv, d).to(torch.bfloat16)
    vc = torch.randn(P, ps, hkv, d).to(torch.bfloat16)
    lens = torch.tensor([1, 16, 17, 90, 5, 33], dtype=torch.int32)
    n = len(lens)
    bt = torch.from_numpy(rng.permutation(P)[: n * 7].reshape(n, 7).astype(np.int32))
    q = torch.randn(n, hq, d)
    out = torch.full_like(q, float("nan"))
    k.paged_decode(q, out, kc, vc, bt, torch.arange(n), torch.arange(n), lens, d ** -0.5)
    for i in range(n):
        L = int(lens[i])
        pg = bt[i, : -(-L // ps)].long()
        kk = kc[pg].reshape(-1, hkv, d)[:L].double().repeat_interleave(hq // hkv, 1)
        vv = vc[pg].reshape(-1, hkv, d)[:L].double().repeat_interleave(hq // hkv, 1)
        p = (torch.einsum("hd,thd->ht", q[i].double(), kk) * d ** -0.5).softmax(-1)
        ref = torch.einsum("ht,thd->hd", p, vv)
        assert (out[i].double() - ref).abs().max() < 1e-5, (i, L)
