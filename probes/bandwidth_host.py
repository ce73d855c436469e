"""What the bandwidth probe measures of the host, apart from the engine's steps: its verdict's controls.

A mixin of BandwidthProbe (bandwidth.py). A low window of steps is the engine's only if the host
was not the reason: the CPU time the process got during a step, a fixed-size copy timed now
against its best since attach (the host control), the share of the host's CPU that other processes
took (/proc/stat ticks, else the load average), and the measured copy peak (engine/peaks.py), kept
as information.
"""
from __future__ import annotations

import time

HOST_SLOW_SHARE = 0.6         # a control under this share of its best: the host itself is slow
CONTROL_CONFIRM_ROUNDS = 2    # more rounds of the control when one reads slow, the best kept
HOST_LOOKBACK_S = 0.25        # the host's load is read over at least this long (ticks are 10 ms)


class HostMeasures:
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

    def _control_gbs(self, repeats: int = 7) -> float:
        """The host control: the best GB/s of `repeats` copies of a fixed size, per CPU-second on a
        CPU as steps are (the best: what the host can do now, least moved by one interrupt)."""
        import torch
        from workbench.engine.device import synchronize
        dev = self.engine.device
        n = max(1, self.control_nbytes // 4)
        src = torch.ones(n, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)                                 # warm-up: first touch of the pages
        synchronize(dev)
        threads = torch.get_num_threads() if dev.type == "cpu" else 1
        rates = []
        for _ in range(repeats):
            c0, w0 = time.process_time(), time.perf_counter()
            dst.copy_(src)
            synchronize(dev)
            wall = max(time.perf_counter() - w0, 1e-9)
            share = min(1.0, (time.process_time() - c0) / (wall * threads)) if dev.type == "cpu" else 1.0
            rates.append(8.0 * n / (wall * max(share, 1e-3)) / 1e9)
        return max(rates)

    def _control_share(self) -> tuple[float, float] | None:
        """(control GB/s now, its share of the best seen since attach); the best is updated. A round
        that reads slow is confirmed by up to CONTROL_CONFIRM_ROUNDS more, the best of them kept."""
        if self.control_nbytes <= 0:
            return None
        ref = self.control_ref_gbs
        now = self._control_gbs()
        for _ in range(CONTROL_CONFIRM_ROUNDS):
            if ref is None or now >= HOST_SLOW_SHARE * ref:
                break
            now = max(now, self._control_gbs())
        self.control_ref_gbs = max(now, ref or 0.0)
        return now, now / self.control_ref_gbs

    def _control_for(self, step: int) -> tuple[float, float] | None:
        """The control for a verdict at `step`: measured now, or the one measured within the last
        window of steps (a regression that lasts must not pay for a control every step)."""
        last = self._control_last
        if last is not None and 0 <= step - last[0] < self.window:
            return last[1]
        control = self.guard(self._control_share)()
        self._control_last = (step, control)
        return control

    def _measure_peak(self, min_bandwidth_gbs: float | None = None, step: int | None = None) -> None:
        from workbench.engine.peaks import peak_figures
        kw = {"nbytes": self.peak_nbytes} if self.peak_nbytes else {}
        if self.peak_nbytes:                  # a small measurement: keep the matmul small too
            kw["n"] = 256
        old = self.peak_gbs
        self.peak = peak_figures(self.engine.device, max_age_days=self.peak_max_age_days,
                                 min_bandwidth_gbs=min_bandwidth_gbs, **kw)
        self.peak_gbs = float(self.peak["bandwidth_gbs"])
        why = self.peak.get("remeasured_because") or []
        if why:
            prev = (self.peak.get("previous") or {}).get("bandwidth_gbs", old)
            busy = " (the host was still busy: best of %d runs)" % self.peak.get("attempts", 1) \
                if self.peak.get("busy") else ""
            self.report(
                "info", f"measured copy peak re-measured ({'; '.join(why)}): "
                        f"{prev if prev is not None else float('nan'):.1f} -> {self.peak_gbs:.1f} GB/s{busy}; "
                        f"it is information here, not the verdict",
                kind="peak-remeasured", step=self.engine.step_count if step is None else step,
                evidence={"reasons": why, "peak": {k: v for k, v in self.peak.items() if k != "previous"},
                          "previous": self.peak.get("previous")})

    def _sample_ticks(self, now: float | None = None) -> None:
        from workbench.engine import peaks
        ticks = peaks.proc_ticks()
        if ticks is not None:
            self._ticks.append((time.perf_counter() if now is None else now, ticks))

    def _others_share(self, since: float) -> float | None:
        """Share of the host's CPU ticks that other processes took from `since` (perf_counter; at
        least HOST_LOOKBACK_S back) to now, from /proc/stat. Too few ticks since attach to tell (a
        verdict within ~100 ms of it): the 1-minute load average less this process's threads, as
        peaks.HostLoad estimates it. None where neither can be read."""
        from workbench.engine import peaks
        now_ticks = peaks.proc_ticks()
        if now_ticks is not None and self._ticks:
            start = min(since, time.perf_counter() - HOST_LOOKBACK_S)
            older = [t for w, t in self._ticks if w <= start]
            share = peaks.others_share(older[-1] if older else self._ticks[0][1], now_ticks)
            if share is not None:
                return share
        return peaks.loadavg_others_share()
