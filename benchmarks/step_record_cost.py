"""What the StepRecord costs every step (it is made whether or not a probe reads it): record_of on a
live decode batch of SmolLM2-135M, against the decode step it belongs to, in one run.

64 requests x 200 prompt tokens decode 40 tokens each; at every full decode step the record is
rebuilt 100 times from that step's schedule and batch. Printed: the median record cost, the median
decode step, and their ratio (goal: well under 1% of a step).

    .venv/bin/python benchmarks/step_record_cost.py [--requests 64] [--prompt 200] [--tokens 40]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine.step import record_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=40)
    a = ap.parse_args()
    eng = Engine.from_default(EngineConfig(num_pages=2048))
    rng = np.random.default_rng(0)
    for _ in range(a.requests):
        eng.add_request(rng.integers(3, 1000, a.prompt).tolist(), SamplingParams(max_tokens=a.tokens, ignore_eos=True))
    steps, rec_ns = [], []
    while eng.has_unfinished():
        t = time.perf_counter_ns()
        eng.step()
        dt = time.perf_counter_ns() - t
        r = eng.step_record
        if r is not None and r.num_rows == a.requests and r.scheduled.max() == 1:
            steps.append(dt)
            t = time.perf_counter_ns()
            for _ in range(100):
                record_of(r.step, r.schedule, r.batch, eng.num_pages)
            rec_ns.append((time.perf_counter_ns() - t) / 100)
    rec, step = float(np.median(rec_ns)), float(np.median(steps))
    print(f"record_of at {a.requests} decode rows: median {rec / 1e3:.1f} us; decode step median {step / 1e6:.1f} ms; "
          f"ratio {rec / step * 100:.3f}% of a step")


if __name__ == "__main__":
    main()
