"""Engine vs Hugging Face transformers on workload A, in one run (SmolLM2-135M, fp32, CPU).

Workload A: 16 requests, prompt lengths spread from 16 to 400 tokens (random ids),
64 new tokens each, greedy. Ours: continuous batching over packed, paged KV.
Theirs: one padded batch through `generate`. Also one request alone, decode tokens/s.

The two run interleaved, `--rounds` times each (ours, theirs, ours, theirs, ...), and the
best round of each side counts: the machine's speed drifts by 10-30% over a minute (a
shared host), and interleaving exposes both sides to the same drift.

    .venv/bin/python benchmarks/engine_vs_hf.py [--requests 16] [--new-tokens 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine.peaks import peak_figures
from workbench.engine.weights import default_model_path


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = np.linspace(16, 400, n).astype(int)
    return [rng.integers(100, 40000, int(L)).tolist() for L in lens]


def hf_model():
    from transformers import LlamaForCausalLM
    p = default_model_path()
    return LlamaForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


def hf_batch(model, prompts, new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):           # left padding, as generate wants for decoder-only
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    assert out.shape[1] - width == new
    return dt


def hf_decode_rate(model, prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        tn = time.perf_counter() - t
    return (new - 1) / (tn - t1)


def ours_batch(engine, prompts, new):
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == new for o in outs)
    return dt


def ours_decode_rate(engine, prompt, new):
    engine.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    engine.step()                                     # prefill + first token
    t = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        n += len(engine.step())
    return n / (time.perf_counter() - t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--single-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each side counts")
    ap.add_argument("--skip-hf", action="store_true", help="only our engine (for profiling)")
    a = ap.parse_args(argv)
    prompts = workload(a.requests)
    total_new = a.requests * a.new_tokens
    peaks = peak_figures(torch.device("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; machine peak: "
          f"{peaks['matmul_gflops']:.0f} GFLOP/s fp32 matmul, {peaks['bandwidth_gbs']:.0f} GB/s copy")

    engine = Engine.from_default(EngineConfig(num_pages=2048, max_num_batched_tokens=2048))
    print(f"ours: attention backend {engine.attn.name!r}, linears {engine.model.linear_backend!r}")
    ours_batch(engine, workload(4, seed=1), 4)          # warm-up
    model = None if a.skip_hf else hf_model()
    if model is not None:
        hf_batch(model, workload(4, seed=1), 4)
    t_ours, t_hf, dec_ours, dec_hf = [], [], [], []
    for r in range(a.rounds):
        engine.reset_prefix_cache()        # round 2 must not be served from round 1's prefix cache
        t_ours.append(ours_batch(engine, prompts, a.new_tokens))
        dec_ours.append(ours_decode_rate(engine, prompts[0], a.single_new_tokens))
        print(f"  round {r + 1}: ours {total_new / t_ours[-1]:6.1f} tok/s, decode {dec_ours[-1]:.1f} tok/s", end="")
        if model is not None:
            t_hf.append(hf_batch(model, prompts, a.new_tokens))
            dec_hf.append(hf_decode_rate(model, prompts[0], a.single_new_tokens))
            print(f" | transformers {total_new / t_hf[-1]:6.1f} tok/s, decode {dec_hf[-1]:.1f} tok/s", end="")
        print()
    t_ours, dec_ours = min(t_ours), max(dec_ours)
    # FLOPs: 2 x params per token through the layers, plus the vocab projection per sampled token
    per_tok = 2 * (engine.model.num_params - engine.model.embed.numel())
    flops = per_tok * (sum(map(len, prompts)) + total_new) + 2 * engine.model.embed.numel() * total_new
    share = flops / t_ours / 1e9 / peaks["matmul_gflops"]
    print(f"ours   workload A: {total_new / t_ours:7.1f} output tok/s ({t_ours:.2f} s), "
          f"{share:.0%} of the machine's matmul rate; one stream decode {dec_ours:.1f} tok/s")
    if model is None:
        return
    t_hf, dec_hf = min(t_hf), max(dec_hf)
    print(f"HF     workload A: {total_new / t_hf:7.1f} output tok/s ({t_hf:.2f} s); "
          f"one stream decode {dec_hf:.1f} tok/s")
    print(f"ratio  workload A: {t_hf / t_ours:.2f}x transformers (target >= 2.5x); "
          f"one stream decode: {dec_ours / dec_hf:.2f}x (target >= 1.3x)")


if __name__ == "__main__":
    main()
