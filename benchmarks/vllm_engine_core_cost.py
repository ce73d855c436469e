"""The plugin's time on vLLM's engine-core thread against vLLM's own scheduler work, side by side.

vLLM's real EngineCore in one process (workbench/adapters/vllm/inproc.py, the vLLM environment, the
tiny model so that 100k blocks fit), the plugin on with a workbench listening, at 64 and 256
running requests and 10k and 100k KV blocks. Each step's `Scheduler.schedule` and
`Scheduler.update_from_output` calls are timed whole (the plugin's hooks inside them), and the
plugin's callbacks inside them are timed apart (every engine-core callback runs through
hooks._guard); vLLM's own time is the difference. Printed per size: the medians per decode step
of vLLM's own schedule + update_from_output, the plugin's, and their ratio. Target: the plugin's engine-core time <= 10% of vLLM's own at 256 requests and 100k blocks.

    .venv/bin/python benchmarks/vllm_engine_core_cost.py [--steps 40] [--sizes 64:10000 256:100000 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_child import run_child, tiny_model  # noqa: E402  (sibling script: benchmarks/ is sys.path[0])


def child(model: str, running: int, blocks: int, steps: int) -> None:
    """In the vLLM environment: one EngineCore, `running` requests decoding, `steps` steps timed."""
    from workbench.adapters.vllm import inproc
    core = inproc.make_core(model, batch_queue=False, num_blocks=blocks, max_num_seqs=running,
                            max_num_batched_tokens=max(2048, running * 8), max_model_len=1024)
    from vllm.v1.core.sched.scheduler import Scheduler
    from workbench.adapters.vllm import hooks
    state = {"in": False, "plugin": 0.0}
    guard = hooks._guard

    def timed_guard(where, fn, *args):               # the plugin's callbacks, timed where they run
        if not state["in"]:
            return guard(where, fn, *args)
        t0 = time.perf_counter()
        try:
            return guard(where, fn, *args)
        finally:
            state["plugin"] += time.perf_counter() - t0

    hooks._guard = timed_guard
    rows = []
    for name in ("schedule", "update_from_output"):
        inner = getattr(Scheduler, name)

        def outer(self, *a, _inner=inner, _name=name, **kw):
            state["in"], state["plugin"] = True, 0.0
            t0 = time.perf_counter()
            try:
                return _inner(self, *a, **kw)
            finally:
                state["in"] = False
                rows.append((_name, time.perf_counter() - t0, state["plugin"]))
        setattr(Scheduler, name, outer)
    prompts = inproc.prompts(running, shared=48)
    for i, p in enumerate(prompts):
        r, wave = core.preprocess_add_request(inproc.request(f"r{i}", p, 900))
        core.add_request(r, wave)
    while len(core.scheduler.running) < running or core.scheduler.waiting:      # prefill everyone
        core.step_fn()
    for _ in range(3):
        core.step_fn()
    rows.clear()
    prof = None
    if os.environ.get("PAGEDKV_BENCH_PROFILE"):          # where the plugin's time goes (cProfile, top 30)
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    whole = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step_fn()
        whole.append(time.perf_counter() - t0)
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumtime").print_stats(os.environ["PAGEDKV_BENCH_PROFILE"], 40)
    per_step = []
    for k in range(0, len(rows) - 1, 2):
        (a, ta, pa), (b, tb, pb) = rows[k], rows[k + 1]
        if (a, b) == ("schedule", "update_from_output"):
            per_step.append((ta + tb - pa - pb, pa + pb))
    n_free = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    print("RESULT " + json.dumps({"running": len(core.scheduler.running), "blocks": blocks, "free": n_free,
                                  "steps": per_step, "whole": whole}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sizes", nargs="+", default=["64:10000", "256:10000", "64:100000", "256:100000"],
                    metavar="RUNNING:BLOCKS")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child[0], int(a.child[1]), int(a.child[2]), int(a.child[3]))
    from tqdm.auto import tqdm
    model = tiny_model()
    print(f"{'running':>8} {'blocks':>8} | {'vLLM own ms/step':>16} {'plugin ms/step':>15} {'plugin/vLLM':>11} | "
          f"{'inline plugin':>13} {'inline/vLLM':>11} | {'whole step ms: off':>18} {'inline':>7} {'thread':>7}")
    runs = [("thread", True, {}), ("inline", True, {"PAGEDKV_VLLM_CHECK_THREAD": "0"}), ("off", False, {})]
    for size in tqdm(a.sizes, desc="sizes", leave=False):
        running, blocks = map(int, size.split(":"))
        got = {}
        for name, plugin, env in runs:
            r = run_child(__file__, [model, running, blocks, a.steps], blocks, plugin=plugin, extra_env=env,
                          timeout_s=1800)
            if isinstance(r, str):
                print(f"{running:>8} {blocks:>8} | {name} failed: {r}")
                break
            got[name] = r
        else:
            med = {n: (statistics.median(s[0] for s in r["steps"]) * 1e3,
                       statistics.median(s[1] for s in r["steps"]) * 1e3,
                       statistics.median(r["whole"]) * 1e3) for n, r in got.items()}
            own, plug, _ = med["thread"]
            _, inl, _ = med["inline"]
            own_inl = med["inline"][0]
            print(f"{got['thread']['running']:>8} {blocks:>8} | {own:16.3f} {plug:15.3f} {plug / own:10.1%} | "
                  f"{inl:13.3f} {inl / own_inl:10.1%} | {med['off'][2]:18.2f} {med['inline'][2]:7.2f} "
                  f"{med['thread'][2]:7.2f}")

if __name__ == "__main__":
    main()
