"""Paged attention against dense attention computed independently (float64, per sequence)."""
import numpy as np
import pytest
import torch

from workbench.engine.attention import CpuPagedAttention, TorchPagedAttention, native
from workbench.engine.attention.cpu_paged import NativeDecode
from workbench.engine.batch import BatchBuilder
from workbench.engine.sequence import SamplingParams, Sequence

HQ, HKV, D = 6, 2, 32


def dense_reference(q, k, v, start):
    """q [n, Hq, D]; k, v [c, Hkv, D]; query j sits at position start + j."""
    q, k, v = q.double(), k.double(), v.double()
    g = HQ // HKV
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,chd->hnc", q, k) / D ** 0.5
    n, c = q.shape[0], k.shape[0]
    allowed = torch.arange(c)[None, :] <= (start + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v)


BACKENDS = [TorchPagedAttention, CpuPagedAttention]


def need_kernel():
    """Where a C++ compiler exists the kernel must build; without one (or on a faked CPU that refuses it)
    the torch path stands."""
    from conftest import require_compiled
    require_compiled(native.ATTENTION, "the compiled CPU attention")


@pytest.fixture(params=BACKENDS, ids=lambda c: c.name)
def backend(request):
    if request.param is CpuPagedAttention:
        need_kernel()
    return request.param


def run_case(rng, page_size, specs, backend=TorchPagedAttention):
    """specs: list of (tokens already cached, tokens computed this step)."""
    total_pages = sum(-(-(a + b) // page_size) for a, b in specs) + 3
    perm = rng.permutation(total_pages).tolist()       # pages scattered over the pool
    kc = torch.zeros(total_pages, page_size, HKV, D)
    vc = torch.zeros_like(kc)
    seqs, fulls, sched = [], [], []
    for i, (cached, new) in enumerate(specs):
        n_tok = cached + new
        pages = [perm.pop() for _ in range(-(-n_tok // page_size))]
        s = Sequence(i, list(range(n_tok)), SamplingParams(), max_len=n_tok + 1)
        s.pages, s.num_computed_tokens = pages, cached
        kf, vf = torch.randn(n_tok, HKV, D), torch.randn(n_tok, HKV, D)
        for pos in range(cached):                       # the prefix is already in the pages
            kc[pages[pos // page_size], pos % page_size] = kf[pos]
            vc[pages[pos // page_size], pos % page_size] = vf[pos]
        seqs.append(s)
        fulls.append((kf, vf))
        sched.append((s, new))
    b = BatchBuilder(4096, 64, 64, page_size, torch.device("cpu")).build(sched)
    k_new = torch.cat([kf[c:] for (kf, _), (c, _) in zip(fulls, specs)])
    v_new = torch.cat([vf[c:] for (_, vf), (c, _) in zip(fulls, specs)])
    q = torch.randn(k_new.shape[0], HQ, D)
    attn = backend(HQ, HKV, D)
    attn.write_kv(k_new, v_new, kc, vc, b)
    out = attn.forward(q, k_new, v_new, kc, vc, b)
    if backend is CpuPagedAttention and any(n == 1 for _, n in specs):
        assert isinstance(b.attn_plan.decode[0], NativeDecode)          # the kernel ran, not the fallback
    if backend is CpuPagedAttention and any(n > 1 for _, n in specs):
        native = b.attn_plan.native_prefill                                # the prefill kernel ran every chunk
        assert native is not None and not native.rest and len(native.chunks) == sum(n > 1 for _, n in specs)
    cu = b.cu_seqlens_q_np
    for i, ((kf, vf), (cached, new)) in enumerate(zip(fulls, specs)):
        ref = dense_reference(q[cu[i]:cu[i + 1]], kf, vf, cached)
        diff = (out[cu[i]:cu[i + 1]].double() - ref).abs().max().item()
        assert diff < 1e-5, f"seq {i} (cached {cached}, new {new}), page {page_size}: {diff}"
    # the cache now holds every token at its slot
    for s, (kf, _) in zip(seqs, fulls):
        got = kc[torch.tensor(s.pages)].reshape(-1, HKV, D)[: kf.shape[0]]
        assert torch.equal(got, kf)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed", "prefix_hit"])
def test_paged_attention_matches_dense(page_size, kind, backend):
    rng = np.random.default_rng(page_size * 7 + len(kind))
    for _ in range(3):
        b = int(rng.integers(1, 7))
        if kind == "prefill":
            specs = [(0, int(rng.integers(1, 300))) for _ in range(b)]
        elif kind == "decode":
            specs = [(int(rng.integers(1, 400)), 1) for _ in range(b)]
        elif kind == "prefix_hit":      # cached prefix of whole pages, then a chunk
            specs = [(page_size * int(rng.integers(1, 4)), int(rng.integers(2, 200))) for _ in range(b)]
        else:
            specs = ([(int(rng.integers(1, 300)), 1) for _ in range(b)]
                     + [(0, int(rng.integers(2, 200))), (int(rng.integers(1, 100)), int(rng.integers(2, 90)))])
        run_case(rng, page_size, specs, backend)


def test_single_token_prompt_and_page_boundaries(backend):
    rng = np.random.default_rng(0)
    run_case(rng, 16, [(0, 1), (15, 1), (16, 1), (31, 2), (0, 16), (0, 17)], backend)


def test_compiled_decode_rejects_a_page_past_the_pool():
    """A bad id raises (as torch's index_select does) instead of reading past the pool."""
    need_kernel()
    ps, pages = 16, 4
    kc, vc = torch.randn(pages, ps, HKV, D), torch.randn(pages, ps, HKV, D)
    q, out = torch.randn(1, HQ, D), torch.empty(1, HQ, D)
    bt = torch.tensor([[0, pages]], dtype=torch.int32)
    args = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    native.kernel().paged_decode(q, out, kc, vc, bt, *args, torch.tensor([ps], dtype=torch.int32), D ** -0.5)
    with pytest.raises(IndexError, match="out of bounds"):
        native.kernel().paged_decode(q, out, kc, vc, bt, *args, torch.tensor([ps + 1], dtype=torch.int32),
                                     D ** -0.5)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_compiled_rms_norm_and_rope_write_match_torch(rows):
    """The compiled per-layer ops equal the torch formulas they replace (model.rms_norm, apply_rope
    followed by the slot write)."""
    import torch.nn.functional as F
    from workbench.engine.model import apply_rope, rope_tables
    need_kernel()
    kern = native.kernel()
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(96, generator=g)
    ref = F.rms_norm(x, (96,), w, 1e-5)
    assert torch.allclose(kern.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-6)

    ps, pages = 16, 64
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g)
    cos, sin = rope_tables(D, 4096, 10000.0)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    slots = torch.randperm(pages * ps, generator=g)[:rows]
    kc, vc = torch.zeros(pages, ps, HKV, D), torch.zeros(pages, ps, HKV, D)
    qk_ref = apply_rope(qkv[:, :(HQ + HKV) * D].view(rows, HQ + HKV, D), cos[pos][:, None], sin[pos][:, None])
    v_ref = qkv[:, (HQ + HKV) * D:].reshape(rows, HKV, D).clone()
    got = qkv.clone()
    kern.rope_write(got, cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, slots, HQ, HKV)
    assert torch.allclose(got[:, :(HQ + HKV) * D].view(rows, HQ + HKV, D), qk_ref, atol=1e-5)
    assert torch.allclose(kc.view(-1, HKV, D)[slots], qk_ref[:, HQ:], atol=1e-5)
    assert torch.equal(vc.view(-1, HKV, D)[slots], v_ref)
    # a slot past the pool raises before anything is written
    bad = slots.clone()
    bad[-1] = pages * ps
    before = kc.clone()
    with pytest.raises(IndexError, match="out of bounds"):
        kern.rope_write(qkv.clone(), cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, bad, HQ, HKV)
    assert torch.equal(kc, before)

    # A native-bf16 model's q|k|v: widened, rotated in float32 and rounded once, in place, and the
    # rounded k and v (as they are) stored into bf16 pages.
    qkv16 = qkv.bfloat16()
    qk16 = apply_rope(qkv16[:, :(HQ + HKV) * D].float().view(rows, HQ + HKV, D), cos[pos][:, None],
                      sin[pos][:, None]).bfloat16()
    kc16, vc16 = torch.zeros(pages, ps, HKV, D, dtype=torch.bfloat16), torch.zeros(pages, ps, HKV, D, dtype=torch.bfloat16)
    got = qkv16.clone()
    kern.rope_write(got, cos[pos].contiguous(), sin[pos].contiguous(), kc16, vc16, slots, HQ, HKV)
    rot = got[:, :(HQ + HKV) * D].view(rows, HQ + HKV, D)
    # the same float32 products, rounded once: equal but where fma contraction tips a rounding
    assert (rot.float() - qk16.float()).abs().max() <= 2 ** -7 * qk16.float().abs().max()
    assert (rot != qk16).float().mean() < 0.01
    assert torch.equal(kc16.view(-1, HKV, D)[slots], rot[:, HQ:])
    assert torch.equal(vc16.view(-1, HKV, D)[slots], qkv16[:, (HQ + HKV) * D:].reshape(rows, HKV, D))
    with pytest.raises(RuntimeError, match="bfloat16 q"):           # bf16 rows into a float32 cache
        kern.rope_write(qkv16.clone(), cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, slots, HQ, HKV)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rope_write_measures_each_rows_k_and_v_absmax_as_it_stores_them(rows):
    """rope_write's absmax out: each row's max |k| (rotated, as stored) and |v|, exactly what a
    reduction of the stored rows gives, NaN and inf included; refused where it cannot hold."""
    from workbench.engine.model import rope_tables
    need_kernel()
    kern = native.kernel()
    g = torch.Generator().manual_seed(rows)
    ps, pages = 16, 64
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g) * 100
    qkv[rows // 2, (HQ + HKV) * D + 3] = float("nan")            # a V of one row
    qkv[rows - 1, HQ * D + 5] = float("inf")                     # a K of another
    cos, sin = rope_tables(D, 4096, 10000.0)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    slots = torch.randperm(pages * ps, generator=g)[:rows]
    kc, vc = torch.zeros(pages, ps, HKV, D), torch.zeros(pages, ps, HKV, D)
    out = torch.full((4, rows), -1.0)
    got = qkv.clone()
    kern.rope_write(got, cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, slots, HQ, HKV, out)
    want = torch.stack([kc.view(-1, HKV * D)[slots].abs().amax(1), vc.view(-1, HKV * D)[slots].abs().amax(1)])
    assert torch.equal(out[:2].isnan(), want.isnan()) and out[1, rows // 2].isnan()
    assert torch.equal(out[:2].nan_to_num(), want.nan_to_num()) and out[0, rows - 1] == float("inf")
    # rows 2, 3: each row's largest per-head L2 norm of the stored k and of the rotated q
    norms = torch.stack([kc.view(-1, HKV, D)[slots].norm(dim=-1).amax(1),
                         got[:, :HQ * D].view(rows, HQ, D).norm(dim=-1).amax(1)])
    assert out[2, rows - 1] == float("inf")
    assert torch.allclose(out[2:], norms, rtol=1e-5, equal_nan=True)
    two = torch.full((2, rows), -1.0)                            # [2, T]: the absmax alone, the same
    kern.rope_write(qkv.clone(), cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, slots, HQ, HKV, two)
    assert torch.equal(two.nan_to_num(), out[:2].nan_to_num())
    plain = qkv.clone()                                          # the store itself is unchanged by measuring
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    kern.rope_write(plain, cos[pos].contiguous(), sin[pos].contiguous(), kc2, vc2, slots, HQ, HKV)
    assert torch.equal(plain.nan_to_num(), got.nan_to_num()) and torch.equal(kc2.nan_to_num(), kc.nan_to_num())
    for bad in (torch.zeros(2, rows + 1), torch.zeros(2, 2 * rows)[:, ::2], torch.zeros(2, rows, dtype=torch.float64),
                torch.zeros(3, rows)):
        with pytest.raises(RuntimeError, match="absmax"):
            kern.rope_write(qkv.clone(), cos[pos].contiguous(), sin[pos].contiguous(), kc, vc, slots, HQ, HKV, bad)
    kc16, vc16 = kc.bfloat16(), vc.bfloat16()
    with pytest.raises(RuntimeError, match="absmax"):            # bf16 rows: no measurement
        kern.rope_write(qkv.bfloat16(), cos[pos].contiguous(), sin[pos].contiguous(), kc16, vc16, slots, HQ, HKV,
                        torch.zeros(2, rows))


def test_compiled_row_absmax_matches_torch_with_nan_and_inf():
    need_kernel()
    x = torch.randn(40, 3, 64)
    x[3, 1, 5], x[7, 0, 0], x[9, 2, 63] = float("nan"), float("inf"), -float("inf")
    got = native.kernel().row_absmax(x.reshape(40, -1))
    ref = x.abs().amax(dim=(1, 2))
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got[~ref.isnan()], ref[~ref.isnan()])
    strided = torch.randn(5, 100)[:, 10:74]                  # rows with a stride, as k/v views of qkv are
    assert torch.equal(native.kernel().row_absmax(strided), strided.abs().amax(dim=1))


@pytest.mark.parametrize("cols", [5, 16, 37, 192])           # under one 16-lane block, exactly one, a tail
def test_compiled_absmax_lanes_keep_nan_inf_and_the_max_wherever_they_fall(cols):
    """The 16-lane loops: a NaN, an inf or the largest value in a lane, in the tail, in any row."""
    need_kernel()
    k = native.kernel()
    for pos in [(0, 0), (2, cols - 1), (1, min(15, cols - 1)), (3, cols // 2)]:
        for val in (float("nan"), float("inf"), -float("inf"), -1e30):
            x = torch.randn(4, cols)
            x[pos] = val
            ref_rows, ref = x.abs().amax(dim=1), x.abs().max()
            assert torch.equal(k.row_absmax(x).nan_to_num(-1), ref_rows.nan_to_num(-1)), (pos, val)
            got = k.absmax(x)
            assert (got != got) if ref.isnan() else got == float(ref), (pos, val)
            parts = [x, x[:, : max(1, cols // 3)]]                              # rows_absmax: C differs per tensor
            want = torch.stack([p.abs().amax(dim=1) for p in parts])
            assert torch.equal(native.rows_absmax(parts).nan_to_num(-1), want.nan_to_num(-1)), (pos, val)


def test_rows_absmax_falls_back_to_torch_off_the_kernel_path():
    """Not float32 (bf16 layers): stacked and reduced by torch, same answer; big float32 rows (a prefill's
    hidden states), compiled over threads, the same answer too."""
    xs = [torch.randn(6, 3, 8).to(torch.bfloat16) for _ in range(3)]
    assert torch.equal(native.rows_absmax(xs), torch.stack([x.reshape(6, -1).abs().amax(1) for x in xs]))
    big = [torch.randn(2048, 576) for _ in range(2)]
    assert torch.equal(native.rows_absmax(big), torch.stack([x.abs().amax(1) for x in big]))
    assert torch.equal(native.row_absmax(big[0]), big[0].abs().amax(1))
    assert native.absmax(big[1]) == float(big[1].abs().max())


# Chunks of one prefill call: (queries n, context c, fresh). Odd block tails (37, 5 of 100, 49), a
# one-token chunk, 16-position items and shorter ones.
PREFILL_SPECS = [(37, 37, True), (5, 40, False), (16, 16, True), (20, 100, False), (1, 1, True), (33, 49, False)]


def prefill_case(hq, hkv, d, cache_dtype, ps, seed, q_scale=1.0, width=8):
    """q / fresh k, v as views of one packed q|k|v buffer, random pages, and the chunk rows."""
    rng = np.random.default_rng(seed)
    P = 64
    kc, vc = torch.randn(P, ps, hkv, d).to(cache_dtype), torch.randn(P, ps, hkv, d).to(cache_dtype)
    T = sum(n for n, _, _ in PREFILL_SPECS)
    qkv = torch.randn(T, (hq + 2 * hkv) * d) * q_scale
    q = qkv[:, : hq * d].view(T, hq, d)
    kf, vf = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d), qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    n_rows = len(PREFILL_SPECS)
    bt = torch.from_numpy(rng.permutation(P)[: n_rows * width].reshape(n_rows, width).astype(np.int32))
    rows, a = [], 0
    for i, (n, c, fresh) in enumerate(PREFILL_SPECS):
        rows.append([a, n, c, i, int(fresh), 0])
        a += n
    return q, kf, vf, kc, vc, bt, rows


def dense_prefill(q, kk, vv, c, d):
    """Causal (bottom-right) attention of q [n, Hq, D] over kk, vv [c, Hkv, D], in float64."""
    n, g = q.shape[0], q.shape[1] // kk.shape[1]
    kk, vv = kk.double().repeat_interleave(g, 1), vv.double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), kk) * d ** -0.5
    s = s.masked_fill(~(torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]), float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), vv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 64), (4, 2, 128), (6, 3, 48)])
def test_compiled_prefill_matches_dense(dtype, hq, hkv, d):
    """The prefill kernel's 512-bit paths (d = 64 / 128) and its generic one (d = 48), fresh chunks
    and chunks reading float32 / bf16 pages, against dense float64 attention on the same values."""
    need_kernel()
    k = native.kernel()
    ps = 16
    q, kf, vf, kc, vc, bt, rows = prefill_case(hq, hkv, d, dtype, ps, seed=d + hq)
    out = torch.full(q.shape, float("nan"))
    k.paged_prefill(q, out, kf, vf, kc, vc, bt, torch.tensor(rows, dtype=torch.int64), d ** -0.5)
    for a, n, c, i, fresh, _ in rows:
        if fresh:
            kk, vv = kf[a:a + n], vf[a:a + n]
        else:
            pg = bt[i, : -(-c // ps)].long()
            kk, vv = kc[pg].reshape(-1, hkv, d)[:c], vc[pg].reshape(-1, hkv, d)[:c]
        ref = dense_prefill(q[a:a + n], kk, vv, c, d)
        assert (out[a:a + n].double() - ref).abs().max() < 1e-5, (a, n, c, fresh)
    with pytest.raises(IndexError, match="out of bounds"):                 # a bad page id raises, reads nothing
        bad = bt.clone()
        bad[1, 0] = kc.shape[0]
        k.paged_prefill(q, out, kf, vf, kc, vc, bad, torch.tensor(rows, dtype=torch.int64), d ** -0.5)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 64), (4, 2, 128), (6, 3, 48)])
def test_compiled_prefill_bf16_dots_match_dense_on_the_rounded_values(hq, hkv, d):
    """bf16 dots (native bf16 on a CPU with avx512_bf16): scores and P.V from bf16 pairs with float32
    sums. Against dense float64 attention on what the pages hold (a fresh chunk's K/V rounded as the
    store rounds them): within bf16's rounding of Q and P, and not the float32 dots' result. Head
    sizes the pair tiles do not cover (48) keep the float32 dots, bit for bit."""
    from workbench.engine.attention.cpu_paged import prefill_bf16_dots
    need_kernel()
    k = native.kernel()
    if not prefill_bf16_dots(k):
        pytest.skip("no avx512_bf16 in this build or CPU")
    ps = 32
    q, kf, vf, kc, vc, bt, rows = prefill_case(hq, hkv, d, torch.bfloat16, ps, seed=7 * d + hq, q_scale=2.0,
                                               width=4)
    chunks = torch.tensor(rows, dtype=torch.int64)
    out32, out16 = torch.full(q.shape, float("nan")), torch.full(q.shape, float("nan"))
    k.paged_prefill(q, out32, kf, vf, kc, vc, bt, chunks, d ** -0.5)
    k.paged_prefill(q, out16, kf, vf, kc, vc, bt, chunks, d ** -0.5, True)
    if d % 32:
        assert torch.equal(out16, out32)
        return
    worst = 0.0
    for a, n, c, i, fresh, _ in rows:
        if fresh:
            kk, vv = kf[a:a + n].bfloat16(), vf[a:a + n].bfloat16()
        else:
            pg = bt[i, : -(-c // ps)].long()
            kk, vv = kc[pg].reshape(-1, hkv, d)[:c], vc[pg].reshape(-1, hkv, d)[:c]
        err = float((out16[a:a + n].double() - dense_prefill(q[a:a + n], kk, vv, c, d)).abs().max())
        # Q and P rounded to bf16 (8 bits): ~1% of |v| at these scores (|s| up to ~15), not ~|v|
        assert err < 0.02 * float(vv.abs().max()), (a, n, c, fresh, err)
        worst = max(worst, err)
    assert worst > 1e-4                                   # really bf16 dots, not the float32 ones
    assert not torch.equal(out16, out32)
    with pytest.raises(RuntimeError, match="bf16 dots"):  # float32 pages: no bf16 dots
        k.paged_prefill(q, out16, kf, vf, kc.float(), vc.float(), bt, chunks, d ** -0.5, True)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 128)])
def test_compiled_prefill_takes_bf16_rows_as_the_widened_ones(hq, hkv, d):
    """A native-bf16 model hands the prefill its bf16 rows (q, fresh k / v, out in bf16): the same
    result as those rows widened through the float32-input bf16 dots, rounded once (bit for bit)."""
    from workbench.engine.attention.cpu_paged import prefill_bf16_dots
    need_kernel()
    k = native.kernel()
    if not prefill_bf16_dots(k):
        pytest.skip("no avx512_bf16 in this build or CPU")
    q, kf, vf, kc, vc, bt, rows = prefill_case(hq, hkv, d, torch.bfloat16, 32, seed=d, q_scale=2.0, width=4)
    q16, k16, v16 = q.bfloat16(), kf.bfloat16(), vf.bfloat16()
    chunks = torch.tensor(rows, dtype=torch.int64)
    out32 = torch.full(q.shape, float("nan"))
    k.paged_prefill(q16.float(), out32, k16.float(), v16.float(), kc, vc, bt, chunks, d ** -0.5, True)
    out16 = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    k.paged_prefill(q16, out16, k16, v16, kc, vc, bt, chunks, d ** -0.5, True)
    assert not out16.isnan().any() and torch.equal(out16, out32.bfloat16())
    with pytest.raises(RuntimeError, match="bf16 dots"):              # bf16 rows always take the bf16 dots
        k.paged_prefill(q16, out16, k16, v16, kc, vc, bt, chunks, d ** -0.5, False)
