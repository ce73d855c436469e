"""The attention check inside vLLM's workers: its cost per step on SmolLM2, and how soon it catches
each math bug planted in vLLM's CPU attention path, over several workloads.

Cost: vLLM's real EngineCore (workbench/adapters/vllm/inproc.py) on SmolLM2 with the plugin on, run
twice, the attention check on and off (PAGEDKV_VLLM_ATTENTION=0) in turn; printed: the check's own
time per check and per step as it timed itself, its share of the median step, and the median step
on / off (that ratio is within this host's run-to-run noise, ~5%: the self-timed share is the figure).
Target (issue 37): <= 2% of step time.

Certainty: each of faults.py's five attention math faults, on vLLM's tiny GQA Llama, under --seeds
workloads (the prompts' seed), counting the execution of the first `vllm_attention` error. Every
fault is on from the first step, so its first effect is at execution 1 (2 for the decode-only ones:
the first execution with a decode row). Target: caught in every seed, within 64 steps of the first
effect; the clean runs of the same seeds silent.

    .venv/bin/python benchmarks/vllm_attention_check.py [--seeds 5] [--skip-cost] [--skip-faults]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm.auto import tqdm  # noqa: E402

from workbench.adapters.vllm.driver import fault_file, run_inproc  # noqa: E402
from workbench.adapters.vllm.faults import MATH_FAULTS  # noqa: E402
from workbench.adapters.vllm.server import vllm_python  # noqa: E402


def tiny_model() -> str:
    import subprocess
    out = tempfile.mkdtemp(prefix="vllm-tiny-")
    code = "import sys\nfrom workbench.adapters.vllm.tiny_model import write_tiny_model_dir as w\nw(sys.argv[1])\n"
    subprocess.run([str(vllm_python()), "-c", code, out], check=True, capture_output=True)
    return out


def cost(requests: int, tokens: int, pairs: int) -> None:
    print(f"cost on SmolLM2 (vLLM CPU build, {requests} requests x {tokens} tokens, {pairs} on/off pairs)")
    on_steps, off_steps, per_check, share = [], [], [], []
    for _ in tqdm(range(pairs), desc="on/off pairs"):
        for on in (True, False):
            r = run_inproc("--requests", str(requests), "--max-tokens", str(tokens), timeout_s=900,
                           env={} if on else {"PAGEDKV_VLLM_ATTENTION": "0"})
            assert r.rc == 0, r.log[-2000:]
            med = statistics.median(r.result["step_s"])
            if not on:
                off_steps.append(med)
                continue
            on_steps.append(med)
            (c,) = r.attention_costs.values()
            per_check.append(c["check_s"] / c["checks"])
            # the check's time per execution (one check each) over the mean step time
            share.append(c["check_s"] / c["executions"] / statistics.mean(r.result["step_s"]))
            print(f"  on: {c['checks']} checks, max error write {c['max_err']['write']:.2g} read "
                  f"{c['max_err']['read']:.2g}, skipped {c['skipped'] or 'none'}")
    print(f"  attention check: {statistics.median(per_check) * 1e3:.2f} ms a check (one check a step); "
          f"self-timed share of the step: {statistics.median(share) * 100:.2f}%")
    print(f"  median step: on {statistics.median(on_steps) * 1e3:.1f} ms, off {statistics.median(off_steps) * 1e3:.1f} "
          f"ms, on / off {statistics.median(on_steps) / statistics.median(off_steps):.3f} (noise ~5%)")


def certainty(seeds: int) -> None:
    model = tiny_model()
    print(f"certainty on the tiny GQA Llama, {seeds} seeds (8 requests x 40 tokens)")
    with tempfile.TemporaryDirectory() as d:
        clean_findings = 0
        for s in tqdm(range(seeds), desc="clean"):
            r = run_inproc("--model", model, "--requests", "8", "--max-tokens", "40", "--seed", str(s))
            clean_findings += sum(1 for f in r.findings if f.probe == "vllm_attention")
        print(f"  clean: {clean_findings} attention findings over {seeds} seeds")
        for fault in MATH_FAULTS:
            first = []
            for s in tqdm(range(seeds), desc=fault, leave=False):
                r = run_inproc("--model", model, "--requests", "8", "--max-tokens", "40", "--seed", str(s),
                               env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(Path(d), fault)})
                errs = [f.step for f in r.findings if f.probe == "vllm_attention" and f.severity == "error"]
                first.append(min(errs) if errs else None)
            caught = [x for x in first if x is not None]
            print(f"  {fault}: caught {len(caught)}/{seeds}; execution of the first finding min "
                  f"{min(caught, default='-')} median {statistics.median(caught) if caught else '-'} "
                  f"max {max(caught, default='-')}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-faults", action="store_true")
    a = ap.parse_args(argv)
    if not vllm_python().exists():
        sys.exit(f"no vLLM environment at {vllm_python()} (make vllm)")
    if not a.skip_cost:
        cost(a.requests, a.max_tokens, a.pairs)
    if not a.skip_faults:
        certainty(a.seeds)


if __name__ == "__main__":
    main()
