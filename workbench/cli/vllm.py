"""kvwb watch (a running vLLM: live summary, findings, an HTML report) and kvwb vllm status (which checks run)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _args_watch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm", required=True, metavar="URL",
                   help="vLLM's OpenAI server, e.g. http://127.0.0.1:8000 (its /metrics is scraped)")
    p.add_argument("--kv-events", default=None, metavar="ADDR",
                   help="the endpoint of vLLM's --kv-events-config, e.g. tcp://127.0.0.1:5557 (bound here)")
    p.add_argument("--kv-replay", default=None, metavar="ADDR",
                   help="its replay_endpoint, to recover KV events dropped in transit")
    p.add_argument("--sanitizer", default=None, metavar="ADDR",
                   help="where the workbench's vLLM plugin sends its findings (vLLM started with "
                        "PAGEDKV_VLLM_SANITIZER=ADDR), e.g. tcp://127.0.0.1:5590 (bound here)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between summary lines (default 1)")
    p.add_argument("--report", default=None, metavar="OUT.html", help="on exit, write a self-contained HTML report")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds (default: at Ctrl-C)")


def cmd_watch(args: argparse.Namespace) -> int:
    from workbench.adapters.vllm.watch import open_connection, watch

    if args.duration is not None and args.duration < 0:
        print(f"kvwb watch: --duration {args.duration:g}: give seconds >= 0", file=sys.stderr)
        return 2
    if args.report and not Path(args.report).resolve().parent.is_dir():
        print(f"kvwb watch: --report {args.report}: no such directory", file=sys.stderr)
        return 2
    try:
        conn = open_connection(args.vllm, kv_events=args.kv_events, sanitizer=args.sanitizer,
                               kv_replay=args.kv_replay, interval_s=args.interval)
    except ValueError as e:
        print(f"kvwb watch: {e}", file=sys.stderr)
        return 2
    try:
        return watch(conn, sys.stdout, interval_s=args.interval, duration_s=args.duration, report=args.report)
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"kvwb watch: cannot write the report {args.report}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        conn.close()


# --------------------------------------------------------------------------
# vllm status
# --------------------------------------------------------------------------


def _args_vllm(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["status"], help="status: which of the plugin's checks run, on which path")
    p.add_argument("--sanitizer", required=True, metavar="ADDR",
                   help="the address vLLM's PAGEDKV_VLLM_SANITIZER names, e.g. tcp://127.0.0.1:5590 (bound here: "
                        "stop `kvwb watch` or the notebook that holds it first)")
    p.add_argument("--wait", type=float, default=7.0, metavar="S",
                   help="seconds to listen (the plugin repeats its status every 5 s while vLLM works; default 7)")


def cmd_vllm(args: argparse.Namespace) -> int:
    """Exit 0: every check heard is active; 1: one is not; 3: nothing heard within --wait."""
    import time as _time

    from workbench.adapters.vllm.listener import SanitizerListener
    if args.wait < 0:
        print(f"kvwb vllm status: --wait {args.wait:g}: give seconds >= 0", file=sys.stderr)
        return 2
    try:
        lis = SanitizerListener(args.sanitizer)
    except ValueError as e:
        print(f"kvwb vllm status: {e}", file=sys.stderr)
        return 2
    try:
        t0 = _time.monotonic()
        while _time.monotonic() - t0 < args.wait and len(lis.statuses) < 2:
            _time.sleep(0.1)
        with lis.lock:
            statuses = dict(lis.statuses)
            procs = list(lis.processes)
    finally:
        lis.close()
    if not statuses:
        print(f"kvwb vllm status: nothing heard on {args.sanitizer} in {args.wait:g} s: is vLLM running with "
              f"PAGEDKV_VLLM_SANITIZER={args.sanitizer} and busy? (the plugin repeats its status while it works)",
              file=sys.stderr)
        return 3
    for p in procs[:1]:
        print(f"vLLM {p.get('vllm_version', '?')}")
    for check, st in sorted(statuses.items()):
        ok = bool(st.get("active"))
        line = f"{check}: {'active via ' + str(st.get('via')) if ok else 'NOT active'}"
        line += f" ({st['path']})" if st.get("path") else ""
        line += f"; {st['reason']}" if st.get("reason") else ""
        print(line)
    return 0 if all(st.get("active") for st in statuses.values()) else 1
