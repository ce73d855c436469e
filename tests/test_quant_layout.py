"""The GGUF's own Q4_1 / Q8_0 blocks as the decode linears' layout (engine/quant_layout.py).

References are independent of the kernel: gguf-py's numpy dequantization (what the loader
uses) for the weights, F.linear in float64 for the products, and the float32 skinny GEMM on
the dequantized weights, which the quantized path must match bit for bit.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from workbench.engine import quant_layout
from workbench.engine.linear import QUANT_MAX_ROWS, Linear
from workbench.engine.quant_layout import QuantBlocks


@pytest.fixture(scope="module")
def kernel(skinny_kernel):
    return skinny_kernel


@pytest.fixture(scope="module")
def routed(skinny_kernel):
    """The skinny GEMM where the linears route decode sizes to it (its AVX-512 kernels built): on an
    AVX2-only CPU its portable build is refused for them (trials.skinny_vectorised), and the linears
    keep float32 weights."""
    from workbench.engine import skinny_gemm
    if skinny_gemm.for_linears() is None:
        pytest.skip("the skinny GEMM is a build of its portable loops here: the linears do not take the blocks")
    return skinny_kernel


def blocks(qtype: str, n: int, k: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """Random weights quantized by gguf-py, and their float32 values as the loader computes them."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, QT[qtype])
    dense = torch.from_numpy(dequantize(raw, QT[qtype]).reshape(n, k).astype(np.float32))
    return QuantBlocks.from_gguf(qtype, raw, n, k), dense


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(200, 576), (48, 1536), (17, 64), (1, 32)])
def test_blocks_widen_to_the_loaders_weights_and_multiply_like_them(kernel, qtype, n, k):
    q, w = blocks(qtype, n, k, seed=n * 7 + k)
    wq, fmt = quant_layout.pack(q)
    assert torch.equal(kernel.unpack_q(wq, k, n, fmt).view(torch.int32), w.view(torch.int32))   # bit for bit
    dense = kernel.pack(w)
    g = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=g)
    for m in (1, 3, 8, 9, 12, 16, 24, 50, QUANT_MAX_ROWS):   # the in-register tile, the buffered ones, tails
        x = torch.randn(m, k, generator=g)
        other = torch.randn(m, n, generator=g)
        ref = F.linear(x.double(), w.double(), bias.double())
        for act, op, want in ((0, 0, ref), (1, 0, F.silu(ref)), (0, 1, ref * other.double()),
                              (0, 2, ref + other.double())):
            got = kernel.gemm_q(x, wq, n, fmt, bias, act, other if op else None, op)
            assert got.shape == (m, n)
            assert (got.double() - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item()), (m, act, op)
            # the same float32 sums in the same order as the dense skinny GEMM
            assert torch.equal(got, kernel.gemm(x, dense, n, bias, act, other if op else None, op)), (m, act, op)


def test_quantized_gemm_rejects_bad_blocks(kernel):
    q, _ = blocks("Q4_1", 32, 64, seed=1)
    wq, fmt = quant_layout.pack(q)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.gemm_q(torch.randn(2, 48), wq, 32, fmt, None, 0, None, 0)
    with pytest.raises(RuntimeError, match="must be uint8"):
        kernel.gemm_q(torch.randn(2, 64), wq, 32, 1, None, 0, None, 0)          # Q4_1 bytes read as Q8_0
    with pytest.raises(RuntimeError, match="fmt must be"):
        kernel.gemm_q(torch.randn(2, 64), wq, 32, 7, None, 0, None, 0)


def test_linear_takes_the_blocks_only_when_they_are_its_weight(routed):
    q, w = blocks("Q4_1", 96, 128, seed=2)
    lin = Linear(w, quant=q)
    assert lin.quant is not None and lin.skinny is None and lin.backend.startswith("skinny[Q4_1]")
    assert torch.equal(lin.dense_weight(), w)
    x = torch.randn(QUANT_MAX_ROWS + 1, 128)
    ref = F.linear(x.double(), w.double())
    for rows in (1, 24, QUANT_MAX_ROWS, QUANT_MAX_ROWS + 1):                # both sides of the switch to oneDNN
        assert (lin(x[:rows]).double() - ref[:rows]).abs().max() < 1e-4
    # One weight changed after loading (a fault, a fine-tune): the blocks no longer describe it.
    w2 = w.clone()
    w2[37, 5] += 0.5
    lin2 = Linear(w2, quant=q)
    assert lin2.quant is None and lin2.skinny is not None
    y = lin2(x[:4])
    assert (y.double() - F.linear(x[:4].double(), w2.double())).abs().max() < 1e-4
    assert (y[:, 37] - lin(x[:4])[:, 37]).abs().max() > 1e-3                # the change is in the output


def test_quant_layout_can_be_turned_off(kernel, monkeypatch):
    q, w = blocks("Q8_0", 32, 64, seed=3)
    monkeypatch.setenv("PAGEDKV_QUANT_LAYOUT", "off")
    assert Linear(w, quant=q).quant is None


def test_default_model_decodes_with_the_files_blocks_bit_for_bit(routed, smollm2_path):
    """SmolLM2's GGUF: every linear takes its blocks (q/k rows un-permuted like the weights), and a
    decode-sized product equals the float32 weights' one exactly."""
    from workbench.engine.model import LlamaModel
    from workbench.engine.weights import load_model
    loaded = load_model(smollm2_path)
    model = LlamaModel(loaded.config, loaded.state_dict, quantized=loaded.quantized)
    lins = [model.lm_head] + [m for L in model.layers[:3] for m in (L.qkv, L.o, L.gate, L.up, L.down)]
    assert all(m.quant is not None for m in lins), [m.backend for m in lins]
    assert model.lm_head.backend.startswith("skinny[Q8_0]") and model.layers[0].qkv.backend.startswith("skinny[Q4_1]")
    sd = loaded.state_dict
    qkv = torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    pairs = [(model.layers[1].qkv, qkv), (model.layers[2].down, sd["model.layers.2.mlp.down_proj.weight"]),
             (model.lm_head, sd["model.embed_tokens.weight"])]
    x16 = torch.randn(16, loaded.config.hidden_size)
    for lin, w in pairs:
        assert torch.equal(lin.dense_weight(), w)
        x = x16 if lin.in_features == x16.shape[1] else torch.randn(16, lin.in_features)
        assert torch.equal(lin(x), routed.gemm(x, routed.pack(w), lin.out_features, None, 0, None, 0))
