"""The skinny GEMM against oneDNN's prepacked linear (its peer) and F.linear, by rows.

SmolLM2-135M's decoder shapes, 30 layers of distinct random weights (so they stream from DRAM as
in a real step, not from cache), fp32 and bf16 weights; best of 5 passes. Prints ms per pass
over all layers, the weight-streaming rate and the ratio oneDNN / skinny: the rows where the
ratio is above 1 are the ones engine/linear.py sends to the skinny GEMM (SKINNY_MAX_ROWS).
With bf16 weights the peer is oneDNN's fp32 kernel over fp32 weights (what the engine would
run without the bf16 path on a CPU without native bf16). The last section runs the same
weights as a GGUF file holds them (Q4_1, quantized by gguf-py) through the skinny GEMM's
quantized path (engine/quant_layout.py, float32 products), against the float32 skinny GEMM
and oneDNN: the rows where it wins are the ones engine/linear.py gives it (QUANT_MAX_ROWS).
On a CPU with native bf16 GEMMs (avx512_bf16 or AMX) a last section runs bf16 activations the
way the native bf16 path does: oneDNN's bf16 kernel against the skinny GEMM's bf16 pair kernel and
the float32 skinny GEMM over the same bf16 weights (activations widened in, outputs rounded back,
both counted): the rows where they win are the ones engine/linear.py gives them in native bf16
(NATIVE_BF16_SKINNY_ROWS, NATIVE_BF16_WIDENING_ROWS).

    .venv/bin/python benchmarks/linear_speed.py [--rows 1,8,16,24,32,48,64,96]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import cpu_bf16, quant_layout, skinny_gemm  # noqa: E402

SHAPES = [(832, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]   # qkv, o, gate, up, down
LAYERS = 30


def best(fn, passes=5) -> float:
    fn()
    out = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,24,32,48,64,96")
    a = ap.parse_args(argv)
    k = skinny_gemm.kernel()
    if k is None:
        raise SystemExit(f"linear_speed: the skinny GEMM is unavailable ({skinny_gemm.unavailable_reason()})")
    g = torch.Generator().manual_seed(0)
    fp32 = [[torch.randn(o, i, generator=g) for o, i in SHAPES] for _ in range(LAYERS)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws] for ws in fp32]
    print(f"{LAYERS} layers of {SHAPES}; ms per pass (weight GB/s)")
    dense = {}
    for dtype in (torch.float32, torch.bfloat16):
        skinny = dense[dtype] = [[k.pack(w.to(dtype)) for w in ws] for ws in fp32]
        nbytes = sum(p.numel() * p.element_size() for ws in skinny for p in ws)
        print(f"== {str(dtype).removeprefix('torch.')} weights ({nbytes / 1e6:.0f} MB a pass)")
        for rows in map(int, a.rows.split(",")):
            xs = [torch.randn(rows, i, generator=g) for _, i in SHAPES]
            t_sk = best(lambda: [k.gemm(x, p, o, None, 0, None, 0) for ws in skinny
                                 for x, p, (o, _) in zip(xs, ws, SHAPES)])
            t_dn = best(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for ws in onednn
                                 for x, p in zip(xs, ws)])
            t_fl = best(lambda: [torch.nn.functional.linear(x, w) for ws in fp32 for x, w in zip(xs, ws)])
            fp32_bytes = sum(w.numel() * 4 for ws in fp32 for w in ws)
            print(f"  {rows:4d} rows: skinny {t_sk * 1e3:7.2f} ms ({nbytes / t_sk / 1e9:5.1f})   "
                  f"oneDNN fp32 {t_dn * 1e3:7.2f} ms ({fp32_bytes / t_dn / 1e9:5.1f})   "
                  f"F.linear fp32 {t_fl * 1e3:7.2f} ms   oneDNN / skinny = {t_dn / t_sk:.2f}x")
    quant_section(k, fp32, onednn, dense[torch.float32], a.rows, g)
    if cpu_bf16.hardware_native():
        native_bf16_section(k, fp32, dense[torch.bfloat16], a.rows, g)


def native_bf16_section(k, fp32, skinny, rows_arg, g):
    bf = torch.bfloat16
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w.to(bf), 16) for w in ws] for ws in fp32]
    pairs = [[k.pack_pairs(w.to(bf)) for w in ws] for ws in fp32] if skinny_gemm.bf16_pairs() else None
    print("== native bf16: bf16 activations, bf16 weights: the skinny GEMM's bf16 pair kernel (vdpbf16ps), "
          "the float32 skinny GEMM over the same weights (activations widened, outputs rounded), oneDNN's bf16 kernel")
    for rows in map(int, rows_arg.split(",")):
        xs = [torch.randn(rows, i, generator=g).to(bf) for _, i in SHAPES]
        t_sk = best(lambda: [k.gemm(x.float(), p, o, None, 0, None, 0).to(bf) for ws in skinny
                             for x, p, (o, _) in zip(xs, ws, SHAPES)])
        t_dn = best(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for ws in onednn
                             for x, p in zip(xs, ws)])
        t_pr = best(lambda: [k.gemm_bf(x, p, o, None, 0, None, 0) for ws in pairs
                             for x, p, (o, _) in zip(xs, ws, SHAPES)]) if pairs else float("nan")
        print(f"  {rows:4d} rows: pairs {t_pr * 1e3:7.2f} ms   skinny widening {t_sk * 1e3:7.2f} ms   "
              f"oneDNN bf16 {t_dn * 1e3:7.2f} ms   oneDNN / pairs = {t_dn / t_pr:.2f}x   "
              f"oneDNN / widening = {t_dn / t_sk:.2f}x")


def quant_section(k, fp32, onednn, skinny, rows_arg, g):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    packs = []
    for ws in fp32:
        layer = []
        for w in ws:
            q = quant_layout.QuantBlocks.from_gguf("Q4_1", quantize(w.numpy(), GGMLQuantizationType.Q4_1), *w.shape)
            layer.append(quant_layout.pack(q))
        packs.append(layer)
    nbytes = sum(p.numel() for ws in packs for p, _ in ws)
    print(f"== GGUF Q4_1 blocks, float32 products ({nbytes / 1e6:.0f} MB a pass)")
    for rows in map(int, rows_arg.split(",")):
        xs = [torch.randn(rows, i, generator=g) for _, i in SHAPES]
        t_q = best(lambda: [k.gemm_q(x, p, o, fmt, None, 0, None, 0) for ws in packs
                            for x, (p, fmt), (o, _) in zip(xs, ws, SHAPES)])
        t_sk = best(lambda: [k.gemm(x, p, o, None, 0, None, 0) for ws in skinny for x, p, (o, _) in zip(xs, ws, SHAPES)])
        t_dn = best(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for ws in onednn
                             for x, p in zip(xs, ws)])
        print(f"  {rows:4d} rows: Q4_1 {t_q * 1e3:7.2f} ms ({nbytes / t_q / 1e9:5.1f})   skinny fp32 {t_sk * 1e3:7.2f} ms"
              f"   oneDNN fp32 {t_dn * 1e3:7.2f} ms   skinny fp32 / Q4_1 = {t_sk / t_q:.2f}x"
              f"   oneDNN / Q4_1 = {t_dn / t_q:.2f}x")


if __name__ == "__main__":
    main()
