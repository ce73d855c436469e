"""Simulate-mode replay speed: the whole Mooncake conversation trace, and time travel.

12,031 requests, lengths as they are, prefix caching on, 16-token pages, every event
recorded in the EventLog; then state_at() over 100 random steps.
Peer: nano-vllm's own Scheduler + BlockManager (pure Python, no model, no events; 16-token
blocks, 65,536 blocks, 256 sequences, 16,384-token budget) replays the same trace in 74 s
on this machine (DESIGN.md); we use the same pool and batch limits.

    .venv/bin/python benchmarks/replay_speed.py [--limit N]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from workbench import EngineConfig
from workbench.trace import read_trace
from workbench.trace.replay import replay
from workbench.trace.timetravel import TimeTravel

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25_conversation" / "conversation_trace.jsonl"
NANO_VLLM_S = 74.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(MOONCAKE))
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args(argv)
    trace = read_trace(a.trace)
    cfg = EngineConfig(page_size=16, num_pages=65536, max_num_seqs=256, max_num_batched_tokens=16384)
    t = time.perf_counter()
    res = replay(trace, cfg, "simulate", limit=a.limit, progress=False)
    wall = time.perf_counter() - t
    n = len(res.requests) + len(res.rejected)
    st = res.engine.stats()
    print(f"simulate: {n} requests, {len(res.steps)} steps, {len(res.log):,} events recorded in {wall:.1f} s "
          f"({n / wall:.0f} req/s; target < 60 s; nano-vllm's scheduler without events: {NANO_VLLM_S:.0f} s "
          f"-> {NANO_VLLM_S / wall:.2f}x); prefix hit {st['prefix_cache_hits'] / max(1, st['prefix_cache_queries']):.1%}")
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
