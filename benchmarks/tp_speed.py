"""Tensor parallel vs one device on workload A, in one run (SmolLM2-135M, fp32, CPU).

TP=1: one process, torch's intra-op threads on every core. TP=2: two processes (this one,
rank 0, and one spawned worker), one thread each on a 2-core machine: the same cores, split
by heads instead of by GEMM tiles, plus two all-reduces per layer (60 a step; through shared
memory between ranks of one host, engine/parallel/shm_allreduce.py) and the plan broadcast and
logits gather over gloo on 127.0.0.1. Prints the throughputs, their ratio, and the share of a
TP=2 step spent inside collectives (waiting for the slower rank included), from each rank's
RankStepFinished events; then the same TP=2 engine with every all-reduce through gloo
(PAGEDKV_TP_ALLREDUCE=gloo). Rounds interleave (TP=1, TP=2, TP=2 gloo, ...), best of each:
the machine drifts.

    .venv/bin/python benchmarks/tp_speed.py [--requests 16] [--new-tokens 64] [--rounds 2] [--tp 2] [--no-gloo]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from engine_vs_hf import workload          # sibling script: benchmarks/ is sys.path[0]
from workbench import Engine, EngineConfig, SamplingParams, Workbench


def run(engine, prompts, new) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == new for o in outs)
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--no-gloo", action="store_true", help="skip the TP run with every all-reduce through gloo")
    a = ap.parse_args(argv)
    prompts = workload(a.requests)
    cores = os.cpu_count() or 1
    cfg = EngineConfig(num_pages=2048, max_num_batched_tokens=2048)
    one = Engine.from_default(cfg)
    tp = Engine.from_default(cfg.replace(tensor_parallel_size=a.tp))
    gloo = None
    if not a.no_gloo:                                   # the same engine, every all-reduce through gloo's TCP
        os.environ["PAGEDKV_TP_ALLREDUCE"] = "gloo"
        try:
            gloo = Engine.from_default(cfg.replace(tensor_parallel_size=a.tp))
        finally:
            del os.environ["PAGEDKV_TP_ALLREDUCE"]
    tp_threads = tp.parallel.num_threads                # torch threads are per process: set before each run
    wb = Workbench(tp, log=True)                        # RankStepFinished from every rank
    wbg = Workbench(gloo, log=True) if gloo is not None else None
    for eng, n in ((one, cores), (tp, tp_threads), (gloo, tp_threads)):     # warm-up
        if eng is not None:
            torch.set_num_threads(n)
            run(eng, workload(4, seed=1), 4)
    t1, t2, t3, logs, logs3 = [], [], [], [], []
    for _ in range(a.rounds):
        torch.set_num_threads(cores)
        t1.append(run(one, prompts, a.new_tokens))
        torch.set_num_threads(tp_threads)
        logs.append(wb.log.seq)
        t2.append(run(tp, prompts, a.new_tokens))
        if gloo is not None:
            logs3.append(wbg.log.seq)
            t3.append(run(gloo, prompts, a.new_tokens))
    toks = a.requests * a.new_tokens
    b1, b2 = min(t1), min(t2)
    best = logs[t2.index(b2)]
    ranks = wb.log.frame("RankStepFinished")
    ranks = ranks[ranks.seq >= best]
    steps = wb.log.frame("StepFinished")
    steps = steps[steps.seq >= best]
    print(f"load average (other work on the machine) {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"machine: {cores} cores; TP=1: 1 process x {cores} threads; TP={a.tp}: {a.tp} processes x {tp_threads} "
          f"thread(s); split: {tp.parallel.plan.describe()}")
    print(f"TP=1 : {toks / b1:7.1f} output tok/s ({b1:.2f} s; rounds {', '.join(f'{t:.2f}' for t in t1)})")
    print(f"TP={a.tp} : {toks / b2:7.1f} output tok/s ({b2:.2f} s; rounds {', '.join(f'{t:.2f}' for t in t2)})")
    print(f"TP={a.tp} / TP=1 throughput: {b1 / b2:.2f}x (all-reduce through {tp.parallel.group.all_reduce_path})")
    for r, g in ranks.groupby("rank"):
        share = g.comm_ns.sum() / g.duration_ns.sum()
        print(f"  rank {r}: {len(g)} steps, median step {g.duration_ns.median() / 1e6:.1f} ms, of which in "
              f"collectives {share:.0%} (median per step {g.comm_ns.median() / 1e6:.1f} ms); "
              f"{g.comm_bytes.sum() / 2**20:.0f} MiB handed to them")
    decode = steps[steps.num_prefill_tokens == 0]
    dsteps = set(decode.step)
    d = ranks[ranks.step.isin(dsteps)]
    if len(d):
        print(f"  decode steps only: median {d.duration_ns.median() / 1e6:.1f} ms per rank, "
              f"{d.comm_ns.sum() / d.duration_ns.sum():.0%} in collectives")
    if gloo is not None:
        b3 = min(t3)
        g3 = wbg.log.frame("RankStepFinished")
        g3 = g3[g3.seq >= logs3[t3.index(b3)]]
        print(f"TP={a.tp}, every all-reduce through gloo: {toks / b3:7.1f} output tok/s ({b3:.2f} s; rounds "
              f"{', '.join(f'{t:.2f}' for t in t3)}): {b1 / b3:.2f}x TP=1; median step "
              f"{g3.duration_ns.median() / 1e6:.1f} ms, {g3.comm_ns.sum() / g3.duration_ns.sum():.0%} in collectives")
        gloo.close()
    tp.close()


if __name__ == "__main__":
    main()
