"""What the probes cost: workload A with no probe vs every probe on, in one run.

The verdict pairs steps, not runs. Two engines load the same model and take the same workload;
the workbench (every probe + the event log) sits on one of them, and the two step in turn, the
order swapped every step, each step timed. Whatever the host does to its speed over a second
(this one drifts by 8% from one 5 s run to the next, in CPU time as in wall time: the CPU itself
runs slower) falls on both engines' steps alike, so the loss within a repeat,
1 - (bare engine's time) / (probed engine's time), keeps only what the probes cost. The probed
engine swaps every repeat (A, then B) and the verdict is the median over repeats. The garbage
collector's passes are timed (gc.callbacks) and charged to the probed engine whichever step they
fell in: its objects are most of what the collector walks, so the figure errs high, not low.
(Until stop 50 the runs themselves were paired, back to back: 5 s apart, the same code read
-18% to 33% in single repeats.)

Beside the verdict: each probe's own callbacks (Probe.guard times them where they run) and an
accounted floor, those callbacks plus the event log's own work, timed in a log-only run.

Also the cost of the event plumbing with nothing attached. That cannot be timed by
switching it off (it is compiled into the step), so it is counted: every emission
site is one `bus.wants(EventType)` set lookup; we count the lookups per step in a
counting run, time one lookup over 10^6 calls, and report lookups x cost / step time.

    .venv/bin/python benchmarks/probe_overhead.py [--requests 16] [--new-tokens 64] [--repeats 11] [--tp 1]
"""
from __future__ import annotations

import argparse
import gc
import time
import timeit

import numpy as np
from tqdm.auto import tqdm

from engine_vs_hf import workload          # sibling script: benchmarks/ is sys.path[0]
from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.events import EventBus, PagesAllocated


def run(engine, prompts, new):
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()          # every run computes its prompts: the workload stays workload A
    t = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - t


class GcClock:
    """Seconds the garbage collector has run since this was made (gc.callbacks)."""

    def __init__(self):
        self.spent, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spent += time.perf_counter() - self._t0

    def close(self):
        gc.callbacks.remove(self._tick)


def paired_steps(engines, prompts, new, repeats, log, desc, probes=True):
    """Per repeat: the workbench (every probe when `probes`, the event log when `log`) on
    engines[r % 2], the other bare; both take the workload, stepping in turn. Returns
    (losses, the probed engine's seconds, the bare one's, each repeat's Workbench.costs() or None, and per
    repeat where the extra time fell: {kind: (probed seconds - bare seconds, the probed engine's callback
    seconds)} for kind "decode" (steps of at most 64 tokens) and "prefill" (the others))."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    losses, on_s, off_s, costs, split = [], [], [], [], []
    clock = GcClock()
    try:
        for r in tqdm(range(repeats), desc=desc):
            on_e, off_e = engines[r % 2], engines[1 - r % 2]
            wb = Workbench(on_e, log=log)
            if probes:
                wb.attach()
            for e in (on_e, off_e):
                e.reset_prefix_cache()           # every run computes its prompts: the workload stays workload A
                for p in prompts:
                    e.add_request(p, params)
            spent = {id(on_e): 0.0, id(off_e): 0.0}
            kinds = {kind: [0.0, 0.0] for kind in ("decode", "prefill")}      # extra seconds, callback seconds
            probe_ns = lambda: sum(p.cost_ns for p in wb.probes.values())      # noqa: E731
            gc_spent, k = 0.0, 0
            while on_e.has_unfinished() or off_e.has_unfinished():
                for e in ((on_e, off_e) if k % 2 == 0 else (off_e, on_e)):
                    if e.has_unfinished():
                        c0 = probe_ns() if e is on_e else 0
                        g0, t0 = clock.spent, time.perf_counter()
                        e.step()
                        g = clock.spent - g0
                        dt = time.perf_counter() - t0 - g
                        spent[id(e)] += dt
                        gc_spent += g
                        kind = kinds["decode" if e.step_record.num_tokens <= 64 else "prefill"]
                        kind[0] += dt if e is on_e else -dt
                        if e is on_e:
                            kind[1] += (probe_ns() - c0) / 1e9
                k += 1
            split.append(kinds)
            costs.append(wb.costs() if probes else None)
            wb.close()                        # probes and the workbench's own subscription: the twin stays bare
            if wb.log is not None:
                wb.log.detach()
            t_on, t_off = spent[id(on_e)] + gc_spent, spent[id(off_e)]
            on_s.append(t_on)
            off_s.append(t_off)
            losses.append(1 - t_off / t_on)
    finally:
        clock.close()
    return np.array(losses), np.array(on_s), np.array(off_s), costs, split


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=11, help="repeats of the paired steps with every probe and the "
                                                           "event log on; the median loss is the verdict")
    ap.add_argument("--side-repeats", type=int, default=5, help="repeats of the same with the probes alone and "
                                                               "with the event log alone")
    ap.add_argument("--tp-repeats", type=int, default=2, help="its TP part: alternating runs of each, best kept")
    ap.add_argument("--tp", type=int, default=2, help="also the rank_consistency probe at this tensor-parallel "
                                                  "size (1: skip)")
    a = ap.parse_args(argv)
    prompts = workload(a.requests)
    cfg = EngineConfig(num_pages=2048, max_num_batched_tokens=2048)
    engines = (Engine.from_default(cfg), Engine.from_default(cfg))        # the probed one and its bare twin
    for e in engines:
        run(e, workload(4, seed=1), 4)                                     # warm-up
    lost, on, off, costs, split = paired_steps(engines, prompts, a.new_tokens, a.repeats, True, "all probes + log")
    lost_bare, *_ = paired_steps(engines, prompts, a.new_tokens, a.side_repeats, False, "probes alone")
    lost_log, *_ = paired_steps(engines, prompts, a.new_tokens, a.side_repeats, True, "event log alone",
                                probes=False)
    toks = a.requests * a.new_tokens
    rng = lambda x: f"range {x.min():.1%} to {x.max():.1%}"
    print(f"no probe : {toks / np.median(off):7.1f} output tok/s (median of its steps' time over repeats, "
          f"{np.median(off):.2f} s)")
    print(f"all probes + event log: {toks / np.median(on):7.1f} output tok/s ({np.median(on):.2f} s)")
    print(f"throughput lost with every probe on: median {np.median(lost):.1%} over {a.repeats} repeats of paired "
          f"steps ({rng(lost)}) (target <= 5%)")
    print(f"  the probes alone (no event log): median {np.median(lost_bare):.1%} ({rng(lost_bare)}); "
          f"the event log alone: median {np.median(lost_log):.1%} ({rng(lost_log)})")
    # where the extra time fell, as shares of the probed run (medians over repeats): decode steps pay the
    # per-forward checks on ~35 ms steps, prefill steps the same checks on ~1.5 s ones
    for kind in ("decode", "prefill"):
        extra = np.array([sp[kind][0] for sp in split]) / on
        cb = np.array([sp[kind][1] for sp in split]) / on
        print(f"  {kind} steps: extra time {np.median(extra):.2%} of the run, of it the probes' callbacks "
              f"{np.median(cb):.2%}, beyond them {np.median(extra - cb):.2%} (the engine's hooks and events, the log, and "
              f"what all of it does to the work around it)")
    i = int(np.argsort(lost)[len(lost) // 2])                # the median repeat's callbacks
    best = costs[i]
    best["share_of_run"] = best["seconds"] / on[i]
    print("time inside each probe's callbacks in the median repeat (Probe.guard times them):")
    for r in best.sort_values("seconds", ascending=False).itertuples():
        print(f"  {r.probe:16s} {r.calls:8d} calls {r.seconds * 1e3:8.1f} ms  {r.share_of_run:6.2%} of the run")
    print(f"  {'all':16s} {int(best.calls.sum()):8d} calls {best.seconds.sum() * 1e3:8.1f} ms  "
          f"{best.seconds.sum() / on[i]:6.2%} of the run")
    shares = np.array([c.seconds.sum() / t for c, t in zip(costs, on)])
    engine = engines[1]
    del engines
    log_share = event_log_share(engine, prompts, a.new_tokens)
    print(f"accounted on the engine thread (a floor: not what it does to the work around it): the probes' "
          f"callbacks {np.median(shares):.2%} of a run (median of {len(shares)}) + the event log's own work "
          f"{log_share:.2%} = {np.median(shares) + log_share:.2%}")

    # plumbing with nothing attached: count bus.wants() calls per step
    calls = 0
    real = engine.bus.wants

    def counting(t):
        nonlocal calls
        calls += 1
        return real(t)
    engine.bus.wants = counting
    steps0 = engine.step_count
    t_off = run(engine, prompts, a.new_tokens)
    steps = engine.step_count - steps0
    del engine.bus.wants
    bus = EventBus()
    per_call = min(timeit.repeat(lambda: bus.wants(PagesAllocated), number=1_000_000, repeat=3)) / 1e6
    per_step = t_off / steps
    cost = calls / steps * per_call
    print(f"event plumbing, nothing attached: {calls / steps:.0f} bus.wants() checks per step x "
          f"{per_call * 1e9:.0f} ns = {cost * 1e6:.1f} us per {per_step * 1e3:.1f} ms step = "
          f"{cost / per_step:.3%} (target <= 1%)")
    if a.tp > 1:
        del engine                       # its memory back before the TP engine loads
        tp_overhead(prompts, a)


def event_log_share(engine, prompts, new) -> float:
    """What the event log itself costs the engine thread, in one log-only run: the model hooks it
    wires in (per-layer KVWritten / AttentionRead rows) and every row it records, timed where they
    run (only the outermost of nested calls counts). Timers wrap the methods for this run only."""
    from workbench.engine.instrumentation import ModelHooks
    from workbench.event_log import EventLog
    spent, depth = [0], [0]

    def timed(fn):
        def wrapper(*args, **kw):
            depth[0] += 1
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter_ns() - t0
        return wrapper
    patched = [(ModelHooks, m) for m in ("begin_forward", "kv_absmax_buffer", "on_kv", "on_attention", "on_hidden",
                                         "end_forward")] + [(EventLog, "record_row")]
    saved = [(cls, m, cls.__dict__[m]) for cls, m in patched]
    for cls, m, fn in saved:
        setattr(cls, m, timed(fn))
    try:
        wb = Workbench(engine, log=True)                  # the log and the workbench's own step record, no probe
        t = run(engine, prompts, new)
        wb.close()
        wb.log.detach()
    finally:
        for cls, m, fn in saved:
            setattr(cls, m, fn)
    return spent[0] / 1e9 / t


def tp_overhead(prompts, a) -> None:
    """The rank_consistency probe (tensor parallel only: on one device it has nothing to compare)."""
    import torch
    engine = Engine.from_default(EngineConfig(num_pages=2048, max_num_batched_tokens=2048, tensor_parallel_size=a.tp))
    torch.set_num_threads(engine.parallel.num_threads)
    run(engine, workload(4, seed=1), 4)
    off, on, costs, exch = [], [], [], []
    for _ in range(a.tp_repeats):                   # best of N: the TP engine's two processes drift alike
        off.append(run(engine, prompts, a.new_tokens))
        wb = Workbench(engine, log=False).attach("rank_consistency")
        on.append(run(engine, prompts, a.new_tokens))
        costs.append(wb.costs())
        exch.append(wb.probe("rank_consistency").frame().exchange_us.median())
        wb.detach()
    toks = a.requests * a.new_tokens
    t_off, t_on = min(off), min(on)
    i = on.index(t_on)
    c = costs[i].set_index("probe").loc["rank_consistency"]
    print(f"TP={a.tp}, no probe: {toks / t_off:7.1f} output tok/s ({t_off:.2f} s); rank_consistency on: "
          f"{toks / t_on:7.1f} tok/s ({t_on:.2f} s): {1 - t_off / t_on:.1%} lost")
    print(f"  rank_consistency: {int(c.calls)} checks, {c.seconds * 1e3:.1f} ms = {c.seconds / t_on:.2%} of the run "
          f"(digest + all-gather, median {exch[i]:.0f} us per step)")
    engine.close()


if __name__ == "__main__":
    main()
