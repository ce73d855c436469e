"""What calling the compiled decode kernel through its torch.library op costs, against the direct call the
CPU backend makes, in one run: the same decode (default: 1 query, 16 tokens of context, so the call's own
cost dominates; --rows / --context for a SmolLM2-sized step), 2000 calls each, alternated 3 times.

    .venv/bin/python benchmarks/kernel_op_overhead.py [--rows 1] [--context 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from workbench.engine.kernels import ATTENTION


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=16)
    a = ap.parse_args()
    k = ATTENTION.get()
    if k is None:
        raise SystemExit(f"no compiled kernels: {ATTENTION.why()}")
    h, hk, d, ps = 9, 3, 64, 16
    w = -(-a.context // ps)
    npages = a.rows * w
    q = torch.randn(a.rows, h, d)
    out = torch.empty_like(q)
    kc, vc = torch.randn(npages, ps, hk, d), torch.randn(npages, ps, hk, d)
    tables = torch.arange(npages, dtype=torch.int32).reshape(a.rows, w)
    tok = rows = torch.arange(a.rows)
    lens = torch.full((a.rows,), a.context, dtype=torch.int32)
    args = (q, out, kc, vc, tables, tok, rows, lens, d ** -0.5)
    calls = {"direct": lambda: k.paged_decode(*args), "torch.ops": lambda: torch.ops.pagedkv.paged_decode(*args)}
    times = {n: [] for n in calls}
    for _ in range(3):
        for name, f in calls.items():
            for _ in range(50):
                f()
            t = time.perf_counter_ns()
            for _ in range(2000):
                f()
            times[name].append((time.perf_counter_ns() - t) / 2000 / 1e3)
    direct, op = statistics.median(times["direct"]), statistics.median(times["torch.ops"])
    print(f"{a.rows} decode rows x {a.context} tokens: direct {direct:.1f} us, torch.ops {op:.1f} us per call; "
          f"ratio {op / direct:.2f}x, {op - direct:.1f} us more per call")


if __name__ == "__main__":
    main()
