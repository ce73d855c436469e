"""Simulate-mode replay speed: the whole Mooncake conversation trace, against bare scheduling.

12,031 requests, lengths as they are, prefix caching on, 16-token pages, 65,536 pages, 256
sequences, a 16,384-token budget, every event recorded in the EventLog; then state_at() over
100 random steps. Peer: a nano-vllm-style Scheduler + BlockManager loop of ours
(benchmarks/bare_loop.py: no events, no model, the same page size, pool, budget and
policy) over the same trace. The two run interleaved, --rounds times each, best of each
(the machine drifts); printed: both times and the ratio.

    .venv/bin/python benchmarks/replay_speed.py [--limit N] [--rounds 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from workbench import EngineConfig
from workbench.data import mooncake_full
from workbench.trace import TimeTravel, read_trace, replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bare_loop import bare_replay  # noqa: E402

TARGET_S = 20.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(mooncake_full() or ""))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args(argv)
    if not a.trace:
        raise SystemExit("replay_speed: the Mooncake trace is not beside this checkout (../shared/traces); "
                         "give --trace")
    trace = read_trace(a.trace)
    records = trace.records[:a.limit] if a.limit else trace.records
    cfg = EngineConfig(page_size=16, num_pages=65536, max_num_seqs=256, max_num_batched_tokens=16384)
    sim_s, bare_s, res = [], [], None
    for _ in range(a.rounds):
        res = None                                   # the previous round's log freed before timing the next
        t = time.perf_counter()
        res = replay(trace, cfg, "simulate", limit=a.limit, progress=False)
        sim_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        steps, preempt, hit = bare_replay(records, cfg.page_size, cfg.num_pages, cfg.max_num_seqs,
                                          cfg.max_num_batched_tokens, cfg.watermark)
        bare_s.append(time.perf_counter() - t)
    wall, bare = min(sim_s), min(bare_s)
    n = len(res.requests) + len(res.rejected)
    st = res.engine.stats()
    print(f"simulate: {n} requests, {len(res.steps)} steps, {len(res.log):,} events recorded in {wall:.1f} s "
          f"({n / wall:.0f} req/s; target <= {TARGET_S:.0f} s); {st['num_preemptions']} preemptions, prefix hit "
          f"{st['prefix_cache_hits'] / max(1, st['prefix_cache_queries']):.1%}")
    print(f"bare loop (nano-vllm-style scheduler + block manager, no events): {steps} steps, {preempt} preemptions, "
          f"prefix hit {hit:.1%} in {bare:.1f} s -> simulate / bare = {wall / bare:.2f}x"
          + (f"  (best of {a.rounds}: simulate {', '.join(f'{x:.1f}' for x in sim_s)} s; "
             f"bare {', '.join(f'{x:.1f}' for x in bare_s)} s)" if a.rounds > 1 else ""))
    t = time.perf_counter()
    res.log.tables                                   # the log keeps rows; columns are built when first read
    columns = time.perf_counter() - t
    print(f"event log: {len(res.log):,} rows into columns in {columns:.1f} s (when first read, outside the replay)")
    t = time.perf_counter()
    tt = TimeTravel(res.log, cfg.num_pages)
    build = time.perf_counter() - t
    rng = random.Random(0)
    times = []
    for _ in range(100):
        s = rng.randint(1, tt.last_step)
        t = time.perf_counter()
        tt.state_at(s)
        times.append(time.perf_counter() - t)
    print(f"time travel: keyframes built in {build:.1f} s (every {tt.keyframe_every} steps); state_at over 100 "
          f"random steps: median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms "
          f"(target median <= 50 ms)")


if __name__ == "__main__":
    main()
