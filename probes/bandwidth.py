"""BandwidthProbe: achieved GB/s per step, judged against what this engine reached before
on this machine, for this model, at the same batch shape.

The bytes a step moves are the engine's model of what its kernels read and write
(StepFinished: bytes_weights, the linears' weights one forward streams; bytes_kv_read,
the pages in the step's attention plan x bytes per page; bytes_kv_written, the K/V rows
of its tokens); bytes / step time is its achieved bandwidth.

The verdict is a regression test, not a share of a copy benchmark: a copy peak says
nothing on a CPU where small-batch decode is not bandwidth bound, and a peak cached
while the host was busy says less. So the probe keeps a per-machine baseline
(`baselines.json` beside `peaks.json`, see BaselineStore): for each device + model
identity (architecture, dtype, KV dtype; not the page size or attention backend, so a
change of those that slows the same shape shows as a regression) + batch-shape bucket
(decode-only or mixed; sequences, powers of two; KV bytes read, powers of two; tokens,
for mixed steps), the GB/s of the last clean steps of that shape. It learns as it runs,
from steps it does not judge low, never while the page size fails the config check,
never from starved CPU steps; it saves at detach. A step is judged once its bucket (or
the next KV bucket up or down) has min_samples clean steps: its GB/s over the bucket's
baseline (the baseline_quantile of those samples). A finding needs the median over the
last `window` judged steps under `threshold` (default 0.5: half of what this shape
reached here before), and those steps must span min_window_s of step time (default 50 ms;
with shorter steps the window takes as many more as that needs): a hiccup of a few
milliseconds (a burst of page faults, a neighbour's burst on the memory bus, a GC pass)
can slow every step of a window of sub-millisecond steps, it must not outvote it. A
production step of 10 ms or more fills the time with its 16 steps. Without a baseline a
step is recorded as unjudged-baseline and nothing is reported. Steps with prefill are
judged the same way but never above info.

The measured copy peak (peaks.peak_figures) stays as a column (share_of_peak),
information only. It is re-measured when stale, measured while the host was busy, or
when a step beats it (implausible); the probe says so in an info finding and the rows.

Steps that move too few bytes to be bandwidth bound (min_bytes) are recorded but not
judged; so are CPU steps during which the process got under min_cpu_share of its
threads' CPU time (a machine shared with other work: the step was starved, not slow;
0.8 with several threads, which stall each other at barriers, 0.2 with one).
On a CPU the rate judged and learned (rate_gbs) is bytes per second of CPU time the
step's threads got (wall x cpu_share), so a busy host does not read as a slower engine.

A host can also be slow without taking CPU time from the process: a hypervisor stealing
cycles that the guest still counts as ours, a clock that dropped (and, when control_nbytes
is larger than the last-level cache, a neighbour saturating memory bandwidth). So before a
window turns into a finding the probe times a control: a fixed copy (control_nbytes) that
no engine change can slow, measured the same way (per CPU-second on a CPU) and compared
with the best the control reached since attach (3 rounds at attach, each the best of 7
copies: an interrupt or a neighbour's burst slows single copies, not the best of them). A
round under HOST_SLOW_SHARE of that best is measured again, up to CONTROL_CONFIRM_ROUNDS more
rounds, keeping the best: a slow host stays slow for the ~10-30 ms that takes, a transient
does not. (On this 2-core VM, idle, after engine steps: a median of 7 copies read 0.5-1.0 of
the best seen, so a 0.75 cut excused real regressions as host-slow; the confirmed best of 7
read 0.76-1.0.) Only a host clearly slower than that (under HOST_SLOW_SHARE of it) excuses
a window, and only when the window's median divided by the control's share clears the
threshold: a host at half speed makes a half-speed step normal, and the probe reports
host-slow (info) instead of blaming the engine. A slower engine on a normal host keeps its
warning. The control costs ~30 ms at attach (3 rounds) and ~2-10 ms when a verdict is due
(up to 3x that on a slow reading), at most once per window of steps; nothing on the other steps.

Before the control, the host's load: other processes busy on this host share its caches and
memory bus with the engine, which slows a step per CPU-second as well (a per-CPU-second rate
takes out time slicing, not that). The probe reads /proc/stat at most every 50 ms at a step;
when a window turns low it reads the share of the host's CPU that other processes took since
the window began (at least the last 250 ms), and over HOST_BUSY_SHARE (0.25) the window is
reported as host-busy (info), not judged as the engine's. A dedicated server stays judged.

Also a config check, at attach and whenever the page size changes: a page size that
is not a power of two >= 16 has no paged kernel and runs a slow fallback (field note 8).

On Ascend, msprof's summaries say what the hardware saw (probes/msprof.py): read_msprof_hbm()
reads hbm_*.csv (HBM read/write bandwidth per memory unit), read_msprof_op_summary() reads
op_summary_*.csv (one row per kernel launch) and kernel_durations() sums it per OP Type (calls,
total / mean / p50 / p99 us, share). BandwidthProbe(msprof_dir=...).hbm() and .kernels() read them
from the probe's msprof output folder.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from itertools import islice
from pathlib import Path
from statistics import median

from probes.msprof import kernel_durations, read_msprof_hbm, read_msprof_op_summary  # noqa: F401 (re-exported)
from workbench.events import BlockTableBound, StepFinished
from workbench.probe import Probe

from .bandwidth_host import CONTROL_CONFIRM_ROUNDS, HOST_LOOKBACK_S, HOST_SLOW_SHARE, HostMeasures  # noqa: F401

PAGE_SIZE_FIX = "use 16, 32, 64 or 128"
MAX_WINDOW_STEPS = 1024       # a window of short steps grows to span min_window_s, up to this many
HOST_BUSY_SHARE = 0.25        # other processes took more of the host's CPU than this while a window ran
HOST_TICKS_EVERY_S = 0.05     # /proc/stat read at most this often, at steps (~50 us a read here)


def page_size_supported(ps: int, backend: str | None = None) -> bool:
    """What paged kernels take: a power of two >= 16; on the npu backend what torch_npu's paged
    ops take, a multiple of 16 up to 512 (128 recommended)."""
    if backend == "npu":
        return ps % 16 == 0 and 16 <= ps <= 512
    return ps >= 16 and ps & (ps - 1) == 0


# The batch-shape buckets and the baseline store: bandwidth_baselines.py.
from .bandwidth_baselines import (BASELINE_FILE, BASELINE_FORMAT, BASELINE_VERSION, BaselineStore,  # noqa: E402,F401
                                  _count_index, _quantile, bucket_label, model_identity, step_bucket)


# ---- the probe -------------------------------------------------------------------------------
class BandwidthProbe(HostMeasures, Probe):
    name = "bandwidth"
    description = ("achieved GB/s per step vs this engine's baseline for the same batch shape on this machine; "
                   "page-size config check")

    def __init__(self, peak_gbs: float | None = None, peak_nbytes: int | None = None,
                 threshold: float | None = 0.5, mixed_threshold: float | None = None,
                 min_bytes: int = 64 << 20, window: int = 16, min_cpu_share: float | None = None,
                 baseline_file: str | Path | None | bool = None, learn: bool = True, min_samples: int = 8,
                 baseline_quantile: float = 0.75, save_every: int = 1000,
                 peak_max_age_days: float | None = 7.0, control_nbytes: int = 8 << 20,
                 min_window_s: float = 0.05, msprof_dir: str | None = None, max_rows: int = 100_000,
                 **params):
        """threshold: share of the bucket's baseline under which a step is low (default 0.5);
        mixed_threshold the same for steps with prefill (default: threshold; reported as info).
        A finding needs the median of the last `window` judged steps under it, steps that together
        took at least min_window_s (more steps when they are shorter, up to MAX_WINDOW_STEPS; 0: just
        `window`). A bucket is judged once it has min_samples clean steps; its baseline is their
        baseline_quantile.
        baseline_file: where baselines are kept (default cache_dir()/baselines.json, beside
        peaks.json; False: in memory only, for this attachment). learn: add clean steps to the
        baselines (False: judge against the stored ones only). save_every: save after that many
        learned steps (0: only at detach).
        peak_gbs: the copy roof, information only (default: peaks.peak_figures, measured once
        per machine and cached, re-measured when older than peak_max_age_days, measured on a busy
        host, or beaten by a step; peak_nbytes sets its measurement size).
        Steps under min_bytes are not judged, nor CPU steps that got under min_cpu_share of their
        threads' CPU time (0: judge all; default 0.8 with several torch threads, where one starved
        thread stalls its siblings at barriers and the step slows far more than its CPU time
        shows, 0.2 with one thread, whose CPU time is the work done).
        control_nbytes: the host control's copy size, timed at attach and again before a
        verdict (0: no control; every low window is the engine's)."""
        super().__init__(peak_gbs=peak_gbs, peak_nbytes=peak_nbytes, threshold=threshold,
                         mixed_threshold=mixed_threshold, min_bytes=min_bytes, window=window,
                         min_cpu_share=min_cpu_share, baseline_file=baseline_file, learn=learn,
                         min_samples=min_samples, baseline_quantile=baseline_quantile, save_every=save_every,
                         peak_max_age_days=peak_max_age_days, control_nbytes=control_nbytes,
                         min_window_s=min_window_s, msprof_dir=msprof_dir, max_rows=max_rows, **params)
        self.max_rows = max_rows
        self.peak_gbs = peak_gbs
        self.peak = None                     # peak_figures' answer when the probe measured it
        self.peak_nbytes = peak_nbytes
        self.peak_max_age_days = peak_max_age_days
        self.threshold = 0.5 if threshold is None else threshold
        self.mixed_threshold = self.threshold if mixed_threshold is None else mixed_threshold
        self.min_bytes = min_bytes
        self.window = window
        self.min_window_s = float(min_window_s)
        self.min_cpu_share = min_cpu_share
        self.baseline_file = baseline_file
        self.learn = learn
        self.min_samples = max(1, int(min_samples))
        self.baseline_quantile = baseline_quantile
        self.save_every = save_every
        self.baselines: BaselineStore | None = None
        self.machine = self.model = self.model_desc = None
        self._mark = None                    # (step, process CPU s, wall s) when this step's forward began
        self.msprof_dir = msprof_dir
        # the judged steps a verdict may look back on: `window` of them, more when they are short
        cap = max(window, MAX_WINDOW_STEPS)
        self._win = {True: deque(maxlen=cap), False: deque(maxlen=cap)}
        self._checked_page_size = None
        self._peak_rechecked = False
        self.control_nbytes = int(control_nbytes)
        self.control_ref_gbs: float | None = None     # the best the host control reached since attach
        self._control_last = None                     # (step, (GB/s, share)): reused for a window of steps
        self._ticks = deque(maxlen=256)               # (perf_counter, /proc/stat ticks), every >= 50 ms

    # ---- lifecycle -----------------------------------------------------------
    def on_attach(self, engine) -> None:
        from workbench.engine.peaks import cache_dir, machine_key
        if self.baseline_file is False:
            path = None
        elif self.baseline_file in (None, True):
            path = cache_dir() / BASELINE_FILE
        else:
            path = Path(self.baseline_file)
        self.baselines = BaselineStore(path, quantile=self.baseline_quantile)
        self.machine = machine_key(engine.device)
        if self.min_cpu_share is None:
            import torch
            self._min_cpu_share = 0.8 if torch.get_num_threads() > 1 else 0.2
        else:
            self._min_cpu_share = self.min_cpu_share
        self.model, self.model_desc = model_identity(engine)
        if self.peak_gbs is None:
            self.guard(self._measure_peak)()
        self.guard(self.check_config)()
        self.control_ref_gbs, self._control_last = None, None    # this attachment's device and host
        self._ticks.clear()
        self._sample_ticks()
        if self.control_nbytes > 0:
            for _ in range(3):                           # the reference, while nothing is slow yet
                self.guard(self._control_share)()
        if engine.device.type == "cpu":
            self.listen(BlockTableBound, self._mark_start)       # bound just before the forward
        self.listen(StepFinished, self.on_step)

    def on_detach(self, engine) -> None:
        self.guard(self.save_baselines)()

    def save_baselines(self):
        """Write what was learned to the baseline file (also done at detach and every save_every steps)."""
        return self.baselines.save() if self.baselines is not None else None

    # ---- config check ----------------------------------------------------------
    def check_config(self) -> None:
        e = self.engine
        ps = e.pool.page_size
        self._checked_page_size = ps
        backend = getattr(e.attn, "name", type(e.attn).__name__)
        if page_size_supported(ps, backend):
            return
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
    def _baseline_for(self, bucket: str, near: list[str]) -> tuple[dict | None, str | None]:
        for b in [bucket] + near:
            ent = self.baselines.baseline(BaselineStore.key(self.machine, self.model, b), self.min_samples)
            if ent is not None:
                return ent, b
        return None, None

    def on_step(self, e: StepFinished) -> None:
        eng = self.engine
        now = time.perf_counter()
        if not self._ticks or now - self._ticks[-1][0] >= HOST_TICKS_EVERY_S:
            self._sample_ticks(now)
        ps = eng.pool.page_size
        if ps != self._checked_page_size:
            self.check_config()
        backend = getattr(eng.attn, "name", type(eng.attn).__name__)
        nbytes = e.bytes_weights + e.bytes_kv_read + e.bytes_kv_written
        seconds = e.duration_ns / 1e9
        gbs = nbytes / seconds / 1e9 if seconds > 0 else math.nan
        decode_only = e.num_prefill_tokens == 0
        cpu_share = self._cpu_share(e.step) if eng.device.type == "cpu" else None
        starved = cpu_share is not None and cpu_share < self._min_cpu_share
        # On a CPU the verdict's rate is per second of CPU the step's threads got (wall x cpu_share):
        # a host busy with other work makes steps slower in wall time, not the engine worse.
        rate = gbs / min(1.0, cpu_share) if cpu_share is not None and cpu_share > 0 else gbs
        big = nbytes >= self.min_bytes and not math.isnan(gbs)
        if (big and not starved and self.peak is not None and not self._peak_rechecked
                and gbs > self.peak_gbs):
            self._peak_rechecked = True                     # once per attachment: it costs a measurement
            self._measure_peak(min_bandwidth_gbs=gbs, step=e.step)
        share = gbs / self.peak_gbs if self.peak_gbs else math.nan
        bucket, near = step_bucket(e)
        ent, base_bucket = (None, None)
        if not big:
            status = "unjudged-small"
        elif starved:
            status = "unjudged-starved"
        else:
            ent, base_bucket = self._baseline_for(bucket, near)
            status = "judged" if ent is not None else "unjudged-baseline"
        base = ent["gbs_baseline"] if ent is not None else math.nan
        ratio = rate / base if ent is not None else math.nan
        thr = self.threshold if decode_only else self.mixed_threshold
        judged = status == "judged"
        low = judged and ratio < thr
        learned = (self.learn and big and not starved and not low
                   and page_size_supported(ps, getattr(self.engine.attn, "name", None)))
        self.rows.append({
            "step": e.step, "bytes": nbytes, "bytes_weights": e.bytes_weights,
            "bytes_kv_read": e.bytes_kv_read, "bytes_kv_written": e.bytes_kv_written,
            "seconds": seconds, "gbs": gbs, "rate_gbs": rate, "tokens": e.num_tokens, "seqs": e.num_seqs,
            "bytes_per_token": nbytes / max(1, e.num_tokens), "decode_only": decode_only, "bucket": bucket,
            "baseline_bucket": base_bucket, "baseline_gbs": base, "vs_baseline": ratio,
            "baseline_page_size": ent.get("page_size") if ent is not None else None,
            "page_size": ps, "peak_gbs": self.peak_gbs, "share_of_peak": share, "cpu_share": cpu_share,
            "status": status, "judged": judged, "low": low, "learned": learned,
        })
        if len(self.rows) > self.max_rows:          # a probe must not become a leak
            del self.rows[: len(self.rows) // 2]
        if learned:
            self.baselines.learn(BaselineStore.key(self.machine, self.model, bucket), rate,
                                 machine=self.machine, model=self.model, model_desc=self.model_desc,
                                 bucket=bucket, page_size=ps, attention_backend=backend)
            if self.save_every and self.baselines.unsaved >= self.save_every:
                self.save_baselines()
        if not judged:
            return
        win = self._win[decode_only]
        win.append((ratio, base_bucket, rate, ent, now, seconds))
        steps = self._verdict_window(win)
        if steps:
            med = median(r for r, *_ in steps)
            if med < thr:
                others = self._others_share(steps[0][-2] - steps[0][-1])
                if others is not None and others > HOST_BUSY_SHARE:
                    self._report_host_busy(e, decode_only, med, thr, others, steps)
                    win.clear()                 # judged again on a whole new window
                    return
                control = self._control_for(e.step)
                if control is not None and control[1] < HOST_SLOW_SHARE and med / control[1] >= thr:
                    self._report_host_slow(e, decode_only, med, thr, control, steps)
                    win.clear()                 # the next verdict needs a whole new window (and control)
                    return
                self._report_low(e, decode_only, med, thr, steps, share, control)

    def _verdict_window(self, win) -> list:
        """The last `window` judged steps, or as many more as it takes for them to span
        min_window_s of step time; [] while there are not that many yet."""
        if len(win) < self.window:
            return []
        span, n = 0.0, 0
        for *_, seconds in reversed(win):
            span += seconds
            n += 1
            if n >= self.window and span >= self.min_window_s:
                return list(islice(win, len(win) - n, None))
        return list(win) if len(win) == win.maxlen else []   # the cap: as far back as it keeps

    @staticmethod
    def _window_words(steps: list) -> str:
        return f"median of the last {len(steps)} judged steps, {sum(x[-1] for x in steps) * 1e3:.3g} ms of steps"

    def _report_excused(self, e: StepFinished, decode_only: bool, med: float, thr: float, steps: list,
                        kind: str, why: str, hint: str, evidence: dict) -> None:
        """A low window that is the host's, not the engine's: an info finding, `why` after the figures."""
        what = "decode-only steps" if decode_only else "steps with prefill"
        self.report(
            "info", f"{what} ran at {med:.0%} of their baseline ({self._window_words(steps)}), but {why}",
            hint=hint + "; the engine is judged again on the next window", kind=kind, step=e.step,
            dedup=(kind, decode_only),
            evidence={"median_vs_baseline": med, "threshold": thr, "window_steps": len(steps),
                      "window_s": sum(x[-1] for x in steps), **evidence})

    def _report_host_busy(self, e: StepFinished, decode_only: bool, med: float, thr: float, others: float,
                          steps: list) -> None:
        self._report_excused(
            e, decode_only, med, thr, steps, "host-busy",
            f"other processes took {others:.0%} of this host's CPU meanwhile (/proc/stat): they share the caches "
            f"and the memory bus with the engine, which a per-CPU-second rate does not take out; not judged as "
            f"the engine's",
            "other work on this host; compare on a quiet host",
            {"host_others_share": others, "host_busy_share": HOST_BUSY_SHARE})

    def _report_host_slow(self, e: StepFinished, decode_only: bool, med: float, thr: float,
                          control: tuple[float, float], steps: list) -> None:
        now, frac = control
        self._report_excused(
            e, decode_only, med, thr, steps, "host-slow",
            f"the host itself was slow: a fixed {self.control_nbytes / 2**20:g} MiB copy ran at {now:.3g} GB/s, "
            f"{frac:.0%} of the {self.control_ref_gbs:.3g} GB/s it reached since attach; relative to the host "
            f"the steps were at {med / frac:.0%}, not a regression of the engine",
            "other work on this host or device (a hypervisor stealing cycles, a neighbour saturating "
            "memory bandwidth, a lowered clock)",
            {"control_gbs": now, "control_best_gbs": self.control_ref_gbs, "control_share": frac,
             "control_nbytes": self.control_nbytes})

    def _report_low(self, e: StepFinished, decode_only: bool, med: float, thr: float, win: list,
                    share: float, control: tuple[float, float] | None = None) -> None:
        what = "decode-only steps" if decode_only else "steps with prefill"
        ps = self.engine.pool.page_size
        backend = getattr(self.engine.attn, "name", type(self.engine.attn).__name__)
        bucket, _ = Counter(b for _, b, *_ in win).most_common(1)[0]
        mine = [(g, ent) for _, b, g, ent, *_ in win if b == bucket]
        ent = mine[-1][1]
        gbs_med = median(g for g, _ in mine)
        base, bps, bback = ent["gbs_baseline"], ent.get("page_size"), ent.get("attention_backend")
        nsamp = len(ent["gbs_samples"])
        peak = (f"; {share:.0%} of the measured copy peak {self.peak_gbs:.1f} GB/s (information, not the verdict)"
                if self.peak_gbs and not math.isnan(share) else "")
        per = " (bytes per CPU-second the step got)" if self.engine.device.type == "cpu" else ""
        msg = (f"{what} ran at {med:.0%} of what this engine reached on this machine for the same batch shape "
               f"({self._window_words(win)}; threshold {thr:.0%}): {bucket}: "
               f"{gbs_med:.3g} GB/s{per} against a baseline of {base:.3g} GB/s (p{self.baseline_quantile * 100:.0f} "
               f"of {nsamp} clean steps at page_size {bps}, backend '{bback}'; now page_size {ps}, "
               f"backend '{backend}'){peak}")
        if not page_size_supported(ps, backend):
            cause = (f"page_size={ps} runs the '{backend}' fallback (the baseline ran at page_size {bps} on "
                     f"'{bback}'): {PAGE_SIZE_FIX}")
        elif bps != ps or bback != backend:
            cause = (f"the page size or attention backend changed since the baseline (page_size {bps} -> {ps}, "
                     f"'{bback}' -> '{backend}'): go back, or check why the new one is slower "
                     f"(field note 12: keep page_size x head_dim near 2048; kvwb doctor says which kernel runs)")
        else:
            cause = ("same page size and backend as the baseline: look for other work sharing the device, a "
                     "slower build (kvwb doctor: is the compiled kernel built?), page-table lookups in the kernel, "
                     "or a change in the engine since the baseline was learned")
        self.report(
            "warn" if decode_only else "info", msg,
            hint=cause, kind="low-bandwidth-decode" if decode_only else "low-bandwidth",
            step=e.step, dedup=("low-bandwidth", decode_only),
            evidence={"median_vs_baseline": med, "threshold": thr, "bucket": bucket, "gbs_median": gbs_med,
                      "window_steps": len(win), "window_s": sum(x[-1] for x in win),
                      "baseline_gbs": base, "baseline_samples": nsamp, "baseline_page_size": bps,
                      "baseline_attention_backend": bback, "baseline_updated_at": ent.get("updated_at"),
                      "baseline_file": str(self.baselines.path) if self.baselines.path else None,
                      "page_size": ps, "attention_backend": backend, "peak_gbs": self.peak_gbs,
                      "share_of_peak": share, "machine": self.machine, "model": self.model_desc,
                      "control_gbs": control[0] if control else None,
                      "control_share": control[1] if control else None})

    def reset(self) -> None:
        """Forget rows, findings and windows; the baselines are this machine's, they stay."""
        super().reset()
        for w in self._win.values():
            w.clear()

    COLUMNS = ["step", "bytes", "bytes_weights", "bytes_kv_read", "bytes_kv_written", "seconds", "gbs", "rate_gbs",
               "tokens", "seqs", "bytes_per_token", "decode_only", "bucket", "baseline_bucket", "baseline_gbs",
               "vs_baseline", "baseline_page_size", "page_size", "peak_gbs", "share_of_peak", "cpu_share",
               "status", "judged", "low", "learned"]

    def frame(self):
        import pandas as pd
        return pd.DataFrame(self.rows, columns=self.COLUMNS)

    def _msprof(self, path):
        p = path or self.msprof_dir
        if not p:
            raise ValueError("no msprof output folder: BandwidthProbe(msprof_dir=...) or pass a path "
                             "(the PROF_* folder msprof --output wrote)")
        return p

    def hbm(self, path: str | None = None):
        """msprof's HBM bandwidth (read_msprof_hbm) with each row's share of the measured peak."""
        df = read_msprof_hbm(self._msprof(path))
        if self.peak_gbs:
            df["share_of_peak"] = df["total_gbs"] / self.peak_gbs
        return df

    def kernels(self, path: str | None = None):
        """Kernel durations per OP Type from msprof's op_summary_*.csv (kernel_durations): where the
        device time of a step went, e.g. PagedAttentionMaskNdKernel against the matmuls."""
        return kernel_durations(read_msprof_op_summary(self._msprof(path)))
