"""BandwidthProbe: achieved memory bandwidth per step against the device's measured peak.

Decode is memory bound: every step streams the weights and the KV pages it attends
over, so bytes / step time against the copy-bandwidth roof says how well the step ran
(field note 11: below ~800 GB/s on a 910B meant page-table lookups were in the way).
Steps with prefill are compute bound, so they are judged against a looser threshold
and never above info. Steps that move too few bytes to be bandwidth bound (a tiny
model, a near-empty batch) are recorded but not judged; so are CPU steps during which
the process got under min_cpu_share of its threads' CPU time (a machine shared with
other work: the step was starved, not slow).

Also a config check, at attach and whenever the page size changes: a page size that
is not a power of two >= 16 has no paged kernel and runs a slow fallback (field note 8).

On Ascend, msprof's hbm_*.csv gives the bandwidth the hardware saw:
read_msprof_hbm() reads it.
"""
from __future__ import annotations

import csv
import math
import time
from collections import deque
from pathlib import Path
from statistics import median

from workbench.events import BlockTableBound, StepFinished
from workbench.probe import Probe

PAGE_SIZE_FIX = "use 16, 32, 64 or 128"


def page_size_supported(ps: int) -> bool:
    """What paged kernels take: a power of two >= 16 (Ascend: a multiple of 16, 128 recommended)."""
    return ps >= 16 and ps & (ps - 1) == 0


class BandwidthProbe(Probe):
    name = "bandwidth"
    description = "achieved GB/s per step vs the measured peak; low-share steps; page-size config check"

    def __init__(self, peak_gbs: float | None = None, peak_nbytes: int | None = None,
                 threshold: float | None = None, mixed_threshold: float | None = None,
                 min_bytes: int = 64 << 20, window: int = 16, min_cpu_share: float = 0.5,
                 msprof_dir: str | None = None, max_rows: int = 100_000, **params):
        """peak_gbs: the roof (default: device.peak_figures, measured once per machine and cached;
        peak_nbytes sets its measurement size). threshold: share of peak under which decode-only
        steps are low (default 0.5 on an accelerator, 0.2 on a shared CPU); mixed_threshold the
        same for steps with prefill (default threshold / 4). A finding needs the median of the
        last `window` judged steps under the threshold; steps under min_bytes are not judged,
        nor CPU steps that got under min_cpu_share of their threads' CPU time (0: judge all)."""
        super().__init__(peak_gbs=peak_gbs, peak_nbytes=peak_nbytes, threshold=threshold,
                         mixed_threshold=mixed_threshold, min_bytes=min_bytes, window=window,
                         min_cpu_share=min_cpu_share, msprof_dir=msprof_dir, max_rows=max_rows, **params)
        self.max_rows = max_rows
        self.peak_gbs = peak_gbs
        self.peak_nbytes = peak_nbytes
        self.threshold = threshold
        self.mixed_threshold = mixed_threshold
        self.min_bytes = min_bytes
        self.window = window
        self.min_cpu_share = min_cpu_share
        self._mark = None                    # (process CPU s, wall s) when this step's forward began
        self.msprof_dir = msprof_dir
        self._shares = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self._checked_page_size = None

    # ---- lifecycle -----------------------------------------------------------
    def on_attach(self, engine) -> None:
        accel = engine.device.type != "cpu"
        if self.threshold is None:
            self.threshold = 0.5 if accel else 0.2
        if self.mixed_threshold is None:
            self.mixed_threshold = self.threshold / 4
        if self.peak_gbs is None:
            self.guard(self._measure_peak)()
        self.guard(self.check_config)()
        if engine.device.type == "cpu" and self.min_cpu_share > 0:
            self.listen(BlockTableBound, self._mark_start)       # bound just before the forward
        self.listen(StepFinished, self.on_step)

    def _mark_start(self, e) -> None:
        self._mark = (e.step, time.process_time(), time.perf_counter())

    def _cpu_share(self, step: int) -> float | None:
        """CPU time the process got from the forward to now, per thread, per wall second."""
        if self._mark is None or self._mark[0] != step:
            return None
        import torch
        _, cpu0, wall0 = self._mark
        wall = time.perf_counter() - wall0
        return (time.process_time() - cpu0) / (wall * torch.get_num_threads()) if wall > 0 else None

    def _measure_peak(self) -> None:
        from workbench.engine.device import peak_figures
        kw = {"nbytes": self.peak_nbytes} if self.peak_nbytes else {}
        if self.peak_nbytes:                  # a small measurement: keep the matmul small too
            kw["n"] = 256
        self.peak = peak_figures(self.engine.device, **kw)
        self.peak_gbs = float(self.peak["bandwidth_gbs"])

    # ---- config check ----------------------------------------------------------
    def check_config(self) -> None:
        e = self.engine
        ps = e.pool.page_size
        self._checked_page_size = ps
        if page_size_supported(ps):
            return
        backend = getattr(e.attn, "name", type(e.attn).__name__)
        self.report(
            "error",
            f"page_size={ps} is not a power of two >= 16: paged-attention kernels (Ascend PagedAttention, "
            f"FlashAttention) do not take it, so attention runs the generic fallback '{backend}', which "
            f"gathers K/V token by token (field note 8: throughput 79 -> 42 tokens/s)",
            hint=f"page_size={ps}: {PAGE_SIZE_FIX} (EngineConfig(page_size=16); 128 recommended on Ascend); "
                 f"keep the start-up validation on (allow_unsupported_page_size=False)",
            kind="page-size", step=e.step_count, dedup=("page-size", ps),
            evidence={"page_size": ps, "attention_backend": backend})

    # ---- per step ---------------------------------------------------------------
    def on_step(self, e: StepFinished) -> None:
        if self.engine.pool.page_size != self._checked_page_size:
            self.check_config()
        nbytes = e.bytes_weights + e.bytes_kv_read + e.bytes_kv_written
        seconds = e.duration_ns / 1e9
        gbs = nbytes / seconds / 1e9 if seconds > 0 else math.nan
        share = gbs / self.peak_gbs if self.peak_gbs else math.nan
        decode_only = e.num_prefill_tokens == 0
        cpu_share = self._cpu_share(e.step) if self.engine.device.type == "cpu" else None
        starved = cpu_share is not None and cpu_share < self.min_cpu_share
        judged = nbytes >= self.min_bytes and not math.isnan(share) and not starved
        thr = self.threshold if decode_only else self.mixed_threshold
        self.rows.append({
            "step": e.step, "bytes": nbytes, "bytes_weights": e.bytes_weights,
            "bytes_kv_read": e.bytes_kv_read, "bytes_kv_written": e.bytes_kv_written,
            "seconds": seconds, "gbs": gbs, "share_of_peak": share, "tokens": e.num_tokens,
            "bytes_per_token": nbytes / max(1, e.num_tokens), "decode_only": decode_only,
            "cpu_share": cpu_share, "judged": judged, "low": judged and share < thr,
        })
        if len(self.rows) > self.max_rows:          # a probe must not become a leak
            del self.rows[: len(self.rows) // 2]
        if not judged:
            return
        win = self._shares[decode_only]
        win.append(share)
        if len(win) == self.window and median(win) < thr:
            self._report_low(e, decode_only, median(win), thr)

    def _report_low(self, e: StepFinished, decode_only: bool, med: float, thr: float) -> None:
        what = "decode-only steps" if decode_only else "steps with prefill"
        ps = self.engine.pool.page_size
        backend = getattr(self.engine.attn, "name", type(self.engine.attn).__name__)
        if not page_size_supported(ps):
            cause = f"page_size={ps} runs the '{backend}' fallback: {PAGE_SIZE_FIX}"
        else:
            cause = ("check the attention backend and page size (field note 12: keep page_size x head_dim "
                     "near 2048), page-table lookups in the kernel, and other work sharing the device")
        self.report(
            "warn" if decode_only else "info",
            f"{what} reach {med * self.peak_gbs:.1f} GB/s, {med:.0%} of the measured peak "
            f"{self.peak_gbs:.1f} GB/s (median of the last {self.window}; threshold {thr:.0%})",
            hint=cause, kind="low-bandwidth-decode" if decode_only else "low-bandwidth",
            step=e.step, dedup=("low-bandwidth", decode_only),
            evidence={"median_share": med, "threshold": thr, "peak_gbs": self.peak_gbs, "page_size": ps,
                      "attention_backend": backend})

    def reset(self) -> None:
        super().reset()
        for w in self._shares.values():
            w.clear()

    def frame(self):
        import pandas as pd
        cols = ["step", "bytes", "bytes_weights", "bytes_kv_read", "bytes_kv_written", "seconds", "gbs",
                "share_of_peak", "tokens", "bytes_per_token", "decode_only", "cpu_share", "judged", "low"]
        return pd.DataFrame(self.rows, columns=cols)

    def hbm(self, path: str | None = None):
        """msprof's HBM bandwidth (read_msprof_hbm) with each row's share of the measured peak."""
        df = read_msprof_hbm(path or self.msprof_dir)
        if self.peak_gbs:
            df["share_of_peak"] = df["total_gbs"] / self.peak_gbs
        return df


# ---- msprof -------------------------------------------------------------------------
HBM_COLUMNS = ("Device_id", "Metric", "Read(MB/s)", "Write(MB/s)")


def _rate(text: str, where: str, col: str) -> float:
    t = text.strip()
    if t.upper() in ("N/A", "NA", ""):          # msprof writes N/A where a unit reported nothing
        return math.nan
    try:
        v = float(t)
    except ValueError:
        raise ValueError(f"{where}: {col} is {text!r}, not a number") from None
    if v < 0 or math.isinf(v):
        raise ValueError(f"{where}: {col} is {text!r}: a bandwidth is finite and >= 0")
    return v


def _read_hbm_file(path: Path) -> list[dict]:
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = None
        for lineno, fields in enumerate(reader, start=1):
            if not fields or all(not f.strip() for f in fields):
                continue
            where = f"{path}:{lineno}"
            if header is None:
                header = [f.strip() for f in fields]
                missing = [c for c in HBM_COLUMNS if c not in header]
                if missing:
                    raise ValueError(f"{where}: header {header} lacks {missing}; msprof hbm_*.csv has "
                                     f"{', '.join(HBM_COLUMNS)}")
                idx = {c: header.index(c) for c in HBM_COLUMNS}
                continue
            if len(fields) != len(header):
                raise ValueError(f"{where}: {len(fields)} fields, the header has {len(header)}")
            dev = fields[idx["Device_id"]].strip()
            if not dev.isdigit():
                raise ValueError(f"{where}: Device_id is {dev!r}, not a device number")
            metric = fields[idx["Metric"]].strip()
            if not metric:
                raise ValueError(f"{where}: Metric is empty")
            r = _rate(fields[idx["Read(MB/s)"]], where, "Read(MB/s)")
            w = _rate(fields[idx["Write(MB/s)"]], where, "Write(MB/s)")
            rows.append({"file": str(path), "line": lineno, "device_id": int(dev), "metric": metric,
                         "read_mbs": r, "write_mbs": w})
        if header is None:
            raise ValueError(f"{path}:1: empty file, expected the header {', '.join(HBM_COLUMNS)}")
    return rows


def read_msprof_hbm(path_or_dir) -> "pd.DataFrame":
    """msprof's hbm_*.csv (a file, or every one under a directory) as a DataFrame:
    file, line, device_id, metric (the memory unit), read_mbs, write_mbs, total_gbs.

    A malformed row raises ValueError naming file:line."""
    import pandas as pd
    p = Path(path_or_dir)
    files = sorted(p.rglob("hbm_*.csv")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no hbm_*.csv under {p} (msprof writes them to the summary folder)")
    rows = [r for f in files for r in _read_hbm_file(f)]
    df = pd.DataFrame(rows, columns=["file", "line", "device_id", "metric", "read_mbs", "write_mbs"])
    df["total_gbs"] = (df["read_mbs"] + df["write_mbs"]) / 1000.0
    return df
