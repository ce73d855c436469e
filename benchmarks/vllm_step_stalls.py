"""Does the plugin stall vLLM's busy loop? The worst and the 99th-percentile step, plugin off and on.

vLLM's real EngineCore in one process (inproc.py, the vLLM environment, the tiny model with
32-token blocks, the CPU backend's multiple: 1M blocks take ~16 GB), 64 requests decoding, every `EngineCore.step_fn`
call timed for --steps steps (past the 256th check, where the plugin used to sweep the whole pool
on vLLM's thread), once with the plugin off and once on (a workbench listening, the flight recorder
on), at 100k and 1M blocks. Printed side by side: median, p99 and worst step, and the plugin's
median / worst added; --old-sweep adds a row with the full sweep on vLLM's thread every 256 checks
(PAGEDKV_VLLM_FULL_EVERY=256, the plugin's default before the rotating slice).

    .venv/bin/python benchmarks/vllm_step_stalls.py [--steps 400] [--blocks 100000 1000000]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_child import run_child, tiny_model  # noqa: E402  (sibling script: benchmarks/ is sys.path[0])


def child(model: str, blocks: int, steps: int, running: int) -> None:
    from workbench.adapters.vllm import inproc
    core = inproc.make_core(model, batch_queue=False, num_blocks=blocks, max_num_seqs=running, block_size=32,
                            max_num_batched_tokens=max(2048, running * 8), max_model_len=4096)
    for i, p in enumerate(inproc.prompts(running, shared=48)):
        r, wave = core.preprocess_add_request(inproc.request(f"r{i}", p, 4000))
        core.add_request(r, wave)
    while len(core.scheduler.running) < running or core.scheduler.waiting:
        core.step_fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step_fn()
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"blocks": len(core.scheduler.kv_cache_manager.block_pool.blocks),
                                  "steps": times}), flush=True)


def run(model: str, blocks: int, steps: int, running: int, plugin: bool, extra: dict | None = None) -> list[float] | str:
    r = run_child(__file__, [model, blocks, steps, running], blocks, plugin, extra)
    return r if isinstance(r, str) else r["steps"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--old-sweep", action="store_true",
                    help="also the plugin with PAGEDKV_VLLM_FULL_EVERY=256: the full sweep on vLLM's thread, as it was")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child[0], int(a.child[1]), int(a.child[2]), int(a.child[3]))
    from tqdm.auto import tqdm
    model = tiny_model()
    print(f"{'blocks':>9} {'plugin':>6} | {'median ms':>9} {'p99 ms':>8} {'worst ms':>9}")
    for blocks in tqdm(a.blocks, desc="pool sizes", leave=False):
        got = {}
        runs = [("off", False, None), ("on", True, None)]
        if a.old_sweep:
            runs.append(("sweep", True, {"PAGEDKV_VLLM_FULL_EVERY": "256"}))
        for label, plugin, extra in runs:
            t = run(model, blocks, a.steps, a.running, plugin, extra)
            if isinstance(t, str):
                print(f"{blocks:>9} {label:>6} | failed: {t}")
                continue
            ms = np.asarray(t) * 1e3
            got.setdefault(plugin, ms)
            print(f"{blocks:>9} {label:>6} | {np.median(ms):9.2f} {np.percentile(ms, 99):8.2f} {ms.max():9.2f}")
        if len(got) == 2:
            print(f"{blocks:>9} {'added':>6} | {np.median(got[True]) - np.median(got[False]):9.2f} "
                  f"{np.percentile(got[True], 99) - np.percentile(got[False], 99):8.2f} "
                  f"{got[True].max() - got[False].max():9.2f}")


if __name__ == "__main__":
    main()
