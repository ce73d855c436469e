"""kvwb replay: a request trace through the simulator or the engine, summarised."""
from __future__ import annotations

import argparse
import sys


def _args_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a request trace (native JSONL/Parquet, Mooncake JSONL, Azure or BurstGPT CSV) or a "
                                 "flight recording / repro bundle directory (its block size, pool size, batching "
                                 "limits and prefix caching are the defaults)")
    p.add_argument("--format", default="auto", help="auto (default), jsonl, parquet, mooncake, azure, burstgpt")
    p.add_argument("--mode", choices=("simulate", "full"), default="simulate",
                   help="simulate: real scheduler + page pool, cost model (fast); full: the real model")
    p.add_argument("--page-size", type=int, default=None, help="default: the recording's block size, else 16")
    p.add_argument("--num-pages", type=int, default=None,
                   help="default: the recording's pool size, else 65536 (simulate), 2048 (full)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--length-scale", type=float, default=None,
                   help="scale prompt/output lengths (default 1 in simulate, 1/32 in full)")
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="scale arrival times")
    p.add_argument("--model", default=None, help="full mode: a GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--report", default=None, metavar="OUT.html", help="write a self-contained HTML report")
    p.add_argument("--chrome-trace", default=None, metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--no-progress", action="store_true")


def cmd_replay(args: argparse.Namespace) -> int:
    from workbench.engine.config import ConfigError, EngineConfig
    from workbench.recorder.reader import load_trace
    from workbench.trace import TraceFormatError, replay

    try:
        trace = load_trace(args.trace, format=args.format)
    except (TraceFormatError, OSError) as e:
        print(f"kvwb replay: {e}", file=sys.stderr)
        return 2
    full = args.mode == "full"
    rec = _recorded_config(args.trace)          # a recording: replay with what it ran with
    kw = {"page_size": args.page_size or rec.get("page_size") or 16,
          "num_pages": args.num_pages or rec.get("num_pages") or (2048 if full else 65536)}
    for k in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        v = getattr(args, k, None) or rec.get(k)
        if v is not None:
            kw[k] = v
    if rec:
        print(f"{args.trace}: recorded by {rec.get('writer', '?')}: " + ", ".join(f"{k}={v}" for k, v in kw.items()))
    try:
        cfg = EngineConfig(**kw)
    except ConfigError as e:
        print(f"kvwb replay: {e}", file=sys.stderr)
        return 2
    scale = args.length_scale if args.length_scale is not None else (1 / 32 if full and not rec else 1.0)
    target = cfg
    if full:
        from workbench import Engine, Workbench
        engine = Engine.from_pretrained(args.model, cfg) if args.model else Engine.from_default(cfg)
        target = Workbench(engine).attach()
    skipped = ", ".join(f"{n} {k}" for k, n in trace.skipped.items())
    print(f"{args.trace}: {len(trace)} requests ({trace.format}{'; skipped ' + skipped if skipped else ''})")
    res = replay(trace, target, args.mode, limit=args.limit, length_scale=scale, time_scale=args.time_scale,
                 max_output_len=args.max_output_len, progress=not args.no_progress)
    st = res.engine.stats()
    print(f"replayed {len(res.requests)} requests in {res.wall_s:.1f} s ({args.mode}); "
          f"{len(res.rejected)} rejected; {len(res.steps)} steps; peak pool usage "
          f"{res.steps['usage'].max():.1%}; {st['num_preemptions']} preemptions; prefix cache hit "
          f"{st['prefix_cache_hits'] / max(1, st['prefix_cache_queries']):.1%} of prompt tokens")
    if len(res.requests):
        r = res.requests
        print(f"TTFT p50 {r['ttft_s'].median():.3f} s, p99 {r['ttft_s'].quantile(0.99):.3f} s; "
              f"TPOT p50 {r['tpot_s'].median() * 1e3:.1f} ms (virtual clock)")
    for tid, why in res.rejected[:5]:
        print(f"  rejected {tid}: {why}")
    f = res.findings
    if f is not None and len(f):
        print(f"findings: {len(f)}")
        for row in f.head(20).itertuples(index=False):
            print(f"  [{row.severity}] {row.probe}: {row.message}")
    elif full:
        print("findings: none")
    if args.report:
        from workbench.export import write_html_report
        print(f"report: {write_html_report(res, args.report)}")
    if args.chrome_trace:
        from workbench.export import write_chrome_trace
        print(f"chrome trace: {write_chrome_trace(res.log, args.chrome_trace)}")
    return 0


def _recorded_config(path) -> dict:
    """The engine settings a flight recording ran with ({} for any other trace)."""
    from workbench.recorder.reader import RecordingError, is_recording, open_recording
    if not is_recording(path):
        return {}
    try:
        rec = open_recording(path)
    except RecordingError:
        return {}
    return {"writer": rec.header.get("writer"), **rec.settings()}
