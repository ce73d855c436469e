"""``kvwb``: the workbench's command line.

Each subcommand is one ``cmd_<name>(args) -> int`` function plus one
``_args_<name>(parser)`` function that declares its options, registered in
``SUBCOMMANDS``. To add one (``replay``, ``serve-metrics``, ...), write those
two functions and add a line to ``SUBCOMMANDS``; keep heavy imports inside
the ``cmd_`` function so ``kvwb --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from .common import DEFAULT_MODEL_DIST, _dist_version, _fmt_bytes, default_model_path  # noqa: F401
from .diff import _args_diff, cmd_diff
from .doctor import NO_NPU, _args_doctor, cmd_doctor, doctor_report  # noqa: F401
from .metrics import _args_dump, _args_serve_metrics, cmd_dump, cmd_serve_metrics
from .replay import _args_replay, cmd_replay
from .vllm import _args_vllm, _args_watch, cmd_vllm, cmd_watch


# name -> (handler, argument declarer, one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None], str]] = {
    "doctor": (cmd_doctor, _args_doctor, "check the install: torch, device, dtypes, bandwidth, matmul, default model"),
    "diff": (cmd_diff, _args_diff, "divergence triage of two sides: identical, drift or corruption, per request"),
    "dump": (cmd_dump, _args_dump, "freeze a flight recording's current window into a repro bundle"),
    "replay": (cmd_replay, _args_replay, "replay a request trace (simulate or full) and summarise what happened"),
    "serve-metrics": (cmd_serve_metrics, _args_serve_metrics, "load an engine and serve its kvwb_* Prometheus metrics over HTTP"),
    "vllm": (cmd_vllm, _args_vllm, "ask a running vLLM's plugin which checks run, on which step path and runner"),
    "watch": (cmd_watch, _args_watch, "watch a running vLLM: live summary, findings, problems; an HTML report on exit"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwb", description="PagedKV Workbench command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (handler, declare, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        declare(p)
        p.set_defaults(_handler=handler)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "_handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
