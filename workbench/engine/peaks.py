"""Peak figures: what the hardware can do at best, measured and cached per machine.

Copy bandwidth and matmul throughput are measured with small micro-benchmarks and
cached per machine + device in a JSON file, so probes can call :func:`peak_figures`
on every run without paying for the measurement. Each entry is stamped with when it
was measured and how busy the host was meanwhile (the share of its CPU time that
other work took, from /proc/stat: :func:`proc_ticks`, :class:`HostLoad`); a figure
that is stale, was measured on a busy host, or that a caller found implausible (a
step beat it) is measured again, best of a few short runs.

``PAGEDKV_CACHE_DIR`` (read through engine/env.py): directory of the cache (default
``$XDG_CACHE_HOME/pagedkv-workbench`` or ``~/.cache/pagedkv-workbench``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Union

import torch

from . import env
from .device import DeviceLike, device_name, resolve_device, synchronize

DEFAULT_BANDWIDTH_BYTES = 256 * 1024 * 1024
DEFAULT_MATMUL_N = 1024
DEFAULT_REPEATS = 5
DEFAULT_PEAK_MAX_AGE_DAYS = 7.0    # a cached peak older than this is measured again
DEFAULT_BUSY_SHARE = 0.25          # other work took more than this share of the host CPU: "busy"
DEFAULT_BUSY_RETRY_S = 300.0       # a busy-marked peak is measured again once it is this old
BUSY_ATTEMPTS = 3                  # a busy measurement is repeated up to this many times, best kept
STEP_MARGIN = 1.25                 # a step rate within this factor of one a re-measure already met: no re-measure

# --------------------------------------------------------------------------
# micro-benchmarks
# --------------------------------------------------------------------------


def _as_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(str(dtype).lower(), str(dtype).lower()).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


_clock = time.perf_counter          # what the samples are timed with (a test drives its own)


def _best_seconds(fn, device: torch.device, repeats: int, min_time_s: float = 0.1, max_iters: int = 10_000,
                  max_time_s: float | None = None) -> float:
    """Best time of one ``fn()`` call after a warm-up.

    Runs at least ``repeats`` times and, for small work, keeps going until
    ``min_time_s`` has passed: on a shared, busy machine one preemption of an
    OpenMP thread would otherwise spoil every sample of a sub-millisecond call.

    ``max_time_s`` (off unless given) is for a measurement that may be very slow
    on some CPUs and is shown, not kept: the samples stop once it has passed
    (after one), and a warm-up that alone took it is the sample. `kvwb doctor`'s
    1024^3 bf16 matmul runs ATen's loops on an AVX2-only CPU (oneDNN has no bf16
    kernel there), ~2 s a call; a page's first touch or one preemption barely
    moves a sample that long. The cached peaks never take it: a warm-up's
    one-time costs must not become a figure that probes judge by.
    """
    t0 = _clock()
    fn()  # warm-up: first touch of pages, kernel selection, caches
    synchronize(device)
    warm_up = _clock() - t0
    if max_time_s is not None and warm_up >= max_time_s:
        return max(warm_up, 1e-9)
    best = float("inf")
    start = _clock()
    i = 0
    while True:
        elapsed = _clock() - start
        if i >= max(1, repeats) and not (elapsed < min_time_s and i < max_iters):
            break
        if max_time_s is not None and i >= 1 and elapsed >= max_time_s:
            break
        t0 = _clock()
        fn()
        synchronize(device)
        best = min(best, _clock() - t0)
        i += 1
    return max(best, 1e-9)


def measure_bandwidth_gbs(
    device: DeviceLike = "auto",
    nbytes: int = DEFAULT_BANDWIDTH_BYTES,
    repeats: int = DEFAULT_REPEATS,
) -> float:
    """Copy bandwidth in GB/s (1e9 bytes/s), counting read + write bytes.

    Copies an ``nbytes`` buffer into another on ``device``; best of
    ``repeats`` after one warm-up. This is the roof for memory-bound work
    (decode attention over KV pages).
    """
    dev = resolve_device(device)
    numel = max(1, int(nbytes) // 4)
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    try:
        seconds = _best_seconds(lambda: dst.copy_(src), dev, repeats)
    finally:
        src = dst = None                  # the buffers go now, not when the figures are returned
    return 2.0 * numel * 4 / seconds / 1e9


def measure_matmul_gflops(
    device: DeviceLike = "auto",
    n: int = DEFAULT_MATMUL_N,
    dtype: Union[str, torch.dtype] = torch.float32,
    repeats: int = DEFAULT_REPEATS,
    max_time_s: float | None = None,
) -> float:
    """Square ``n x n`` matmul throughput in GFLOP/s (2 n^3 flops), best of ``repeats``
    (fewer where a slow call passes ``max_time_s``: see ``_best_seconds``)."""
    dev = resolve_device(device)
    dt = _as_dtype(dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
    b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
    out = torch.empty(n, n, device=dev, dtype=dt)
    seconds = _best_seconds(lambda: torch.matmul(a, b, out=out), dev, repeats, max_time_s=max_time_s)
    return 2.0 * n**3 / seconds / 1e9


# --------------------------------------------------------------------------
# cached peak figures
# --------------------------------------------------------------------------

_CACHE_LOCK = threading.Lock()
_CACHE_FILE = "peaks.json"


def cache_dir() -> Path:
    moved = env.value("PAGEDKV_CACHE_DIR")
    if moved:
        return Path(moved).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv-workbench"


def machine_key(device: DeviceLike = "auto") -> str:
    """What identifies "this machine" for cached figures: hostname, device and its name,
    torch version and thread count (the key of peaks.json; baselines are kept under it too)."""
    return _cache_key(resolve_device(device))[0]


def proc_ticks() -> tuple[int, int, int] | None:
    """(busy, total) clock ticks of the whole host from /proc/stat (steal counts as busy),
    and this process's ticks from times(2) (utime + stime: the same accounting, so they subtract).
    /proc/stat is kept open and read with pread: the bandwidth probe asks every few steps, and an
    open() each time cost ~25 us warm, several times that between steps."""
    global _STAT_FD
    try:
        with _STAT_LOCK:
            if _STAT_FD is None:
                _STAT_FD = os.open("/proc/stat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                first = os.pread(_STAT_FD, 512, 0).split(b"\n", 1)[0]
            except OSError:               # the descriptor was closed under us (a daemonising fork): reopen
                _STAT_FD = os.open("/proc/stat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                first = os.pread(_STAT_FD, 512, 0).split(b"\n", 1)[0]
            if not first.startswith(b"cpu "):   # the number now names another file: reopen next time
                _STAT_FD = None
                return None
        v = [int(x) for x in first.split()[1:9]]
        t = os.times()
        ours = round((t.user + t.system) * _CLK_TCK)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    if len(v) < 8:
        return None
    total = sum(v)                               # user nice system idle iowait irq softirq steal
    return total - v[3] - v[4], total, ours


_STAT_FD: int | None = None
_STAT_LOCK = threading.Lock()
try:
    _CLK_TCK = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):      # not a POSIX host: proc_ticks() is None there anyway
    _CLK_TCK = 100


def others_share(t0: tuple[int, int, int], t1: tuple[int, int, int], min_ticks: int = 20) -> float | None:
    """Share of the host's ticks between two proc_ticks() readings that other processes took
    (busy less ours, over all); None under min_ticks (too few to tell)."""
    busy, total, ours = t1[0] - t0[0], t1[1] - t0[1], t1[2] - t0[2]
    if total < min_ticks:
        return None
    return min(1.0, max(0.0, (busy - ours) / total))


def loadavg_others_share() -> float | None:
    """Without ticks to count: the 1-minute load average less this process's threads, per CPU."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    return min(1.0, max(0.0, (load - torch.get_num_threads()) / (os.cpu_count() or 1)))


class HostLoad:
    """How much of the host's CPU other work took while a block ran.

    ``others_share``: the host's busy ticks (steal included) not spent by this process,
    over all ticks (Linux /proc/stat); None when the block was too short to count (under
    20 ticks); without /proc, an estimate from the 1-minute load average less this
    process's threads. ``busy`` is others_share > busy_share (None: cannot tell).

    >>> with HostLoad() as load:
    ...     pass
    >>> sorted(load.figures())
    ['cpu_count', 'host_load_method', 'host_others_share', 'load_avg_1m']
    """

    def __init__(self, busy_share: float = DEFAULT_BUSY_SHARE) -> None:
        self.busy_share = busy_share
        self.others_share: float | None = None
        self.method = "none"

    def __enter__(self) -> "HostLoad":
        self._t0 = proc_ticks()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = proc_ticks()
        self.wall_s = time.perf_counter() - self._w0
        t0 = self._t0
        if t0 is not None and t1 is not None:
            self.others_share = others_share(t0, t1)
            # too short to tell: the load average is not this block
            self.method = "/proc/stat" if self.others_share is not None else "too short"
            return
        self.others_share = loadavg_others_share()
        if self.others_share is not None:
            self.method = "loadavg"

    @property
    def busy(self) -> bool | None:
        return None if self.others_share is None else self.others_share > self.busy_share

    def figures(self) -> dict[str, Any]:
        try:
            load1 = round(os.getloadavg()[0], 2)
        except (OSError, AttributeError):
            load1 = None
        return {"host_others_share": None if self.others_share is None else round(self.others_share, 3),
                "host_load_method": self.method, "load_avg_1m": load1, "cpu_count": os.cpu_count()}


def _cache_key(dev: torch.device) -> tuple[str, dict[str, Any]]:
    parts = {
        "hostname": socket.gethostname(),
        "device": str(dev),
        "device_name": device_name(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    key = "|".join(
        [parts["hostname"], f"{parts['device']} {parts['device_name']}", f"torch {parts['torch']}", f"threads {parts['threads']}"]
    )
    # A CPU faked by PAGEDKV_CPU_FEATURES / PAGEDKV_MARCH / PAGEDKV_MACHINE (make test-cpus) runs other kernels on
    # the same host: it is another machine for its peaks and baselines, never judged against the real one's.
    faked = [f"{n}={env.value(n)}" for n in ("PAGEDKV_CPU_FEATURES", "PAGEDKV_MARCH", "PAGEDKV_MACHINE") if env.value(n)]
    if faked:
        parts["faked_cpu"] = ", ".join(faked)
        key += f"|faked {parts['faked_cpu']}"
    return key, parts


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (a temp file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _age_s(stamp: Any) -> float | None:
    try:
        t = _dt.datetime.fromisoformat(str(stamp))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return (_dt.datetime.now(_dt.timezone.utc) - t).total_seconds()


def _peak_problems(entry: dict[str, Any], max_age_days: float | None, busy_retry_s: float,
                   min_bandwidth_gbs: float | None) -> list[str]:
    """Why a cached peak entry is not to be trusted (empty: it is)."""
    why = []
    bw = entry["bandwidth_gbs"]
    age = _age_s(entry.get("measured_at"))
    if age is None:
        why.append("no measurement time")
    elif max_age_days is not None and age > max_age_days * 86400:
        why.append(f"stale: measured {age / 86400:.1f} days ago (max {max_age_days:g})")
    if "busy" not in entry:
        why.append("measured without a check of the host's load")
    elif entry.get("busy") and (age is None or age >= busy_retry_s):
        share = entry.get("host_others_share")
        why.append("measured while the host was busy"
                   + (f" (other work took {share:.0%} of its CPU)" if isinstance(share, (int, float)) else ""))
    if not bw > 0 or bw != bw or bw == float("inf"):
        why.append(f"implausible: {bw!r} GB/s")
    elif (min_bandwidth_gbs is not None and bw < min_bandwidth_gbs
          and min_bandwidth_gbs > STEP_MARGIN * entry.get("steps_reached_gbs", 0.0)):
        # A step rate a re-measurement already met (and the copy stayed below: caches) is this
        # machine's normal, not a sign the entry is wrong: measuring again would find the same.
        why.append(f"implausible: a step reached {min_bandwidth_gbs:.1f} GB/s, above the cached {bw:.1f} GB/s")
    return why


def _measure_peaks(dev: torch.device, nbytes: int, n: int, repeats: int, busy_share: float) -> dict[str, Any]:
    """Bandwidth and matmul, with the host's load meanwhile; a busy measurement is repeated
    (up to BUSY_ATTEMPTS, short pauses between) and the best figures kept."""
    best: dict[str, Any] | None = None
    attempts = 0
    for attempt in range(BUSY_ATTEMPTS):
        if attempt:
            time.sleep(0.25)
        attempts += 1
        with HostLoad(busy_share) as load:
            bw = measure_bandwidth_gbs(dev, nbytes=nbytes, repeats=repeats)
            mm = measure_matmul_gflops(dev, n=n, dtype=torch.float32, repeats=repeats)
        # Only a CPU's figures depend on the host's CPU; an accelerator's load is not seen here.
        busy = bool(load.busy) if dev.type == "cpu" and load.busy is not None else (False if dev.type == "cpu" else None)
        fig = {"bandwidth_gbs": bw, "matmul_gflops": mm, **load.figures(), "busy": busy}
        if best is None:
            best = fig
        else:
            quiet = [f["host_others_share"] for f in (best, fig) if f["host_others_share"] is not None]
            best = {**(fig if fig["bandwidth_gbs"] > best["bandwidth_gbs"] else best),
                    "bandwidth_gbs": max(bw, best["bandwidth_gbs"]),
                    "matmul_gflops": max(mm, best["matmul_gflops"]),
                    "busy": bool(best["busy"] and busy),
                    "host_others_share": min(quiet) if quiet else None}
        if not best["busy"]:
            break
    best["attempts"] = attempts
    return best


def peak_figures(
    device: DeviceLike = "auto",
    *,
    refresh: bool = False,
    nbytes: int = DEFAULT_BANDWIDTH_BYTES,
    n: int = DEFAULT_MATMUL_N,
    repeats: int = DEFAULT_REPEATS,
    max_age_days: float | None = DEFAULT_PEAK_MAX_AGE_DAYS,
    min_bandwidth_gbs: float | None = None,
    busy_share: float = DEFAULT_BUSY_SHARE,
    busy_retry_s: float = DEFAULT_BUSY_RETRY_S,
) -> dict[str, Any]:
    """Measured copy bandwidth and fp32 matmul throughput of ``device``, cached.

    The cache (``cache_dir()/peaks.json``) is keyed by hostname, device and
    its name, torch version and thread count. An entry is measured again when
    it was measured with other sizes, on ``refresh=True``, or when it is not to
    be trusted: older than ``max_age_days`` (None: never stale), measured while
    other work took more than ``busy_share`` of the host's CPU (``busy``; such an
    entry is retried once it is ``busy_retry_s`` old, so back-to-back calls on a
    loaded host do not measure every time), written without a load check (an
    older cache), or below ``min_bandwidth_gbs`` (a caller saw a step move more
    than the "peak": implausible). A measurement on a busy host is repeated up to
    BUSY_ATTEMPTS times and the best kept.

    Returns a dict with ``bandwidth_gbs``, ``matmul_gflops``, the key fields,
    ``measured_at``, ``busy``, ``host_others_share`` (share of the host's CPU
    that other work took meanwhile; None where it cannot be told), ``attempts``,
    ``source`` (``"cache"`` or ``"measured"``), ``cache_file``, and
    ``remeasured_because`` (why a cached entry was replaced; empty otherwise)
    with ``previous`` (the replaced entry's figures) when it was.
    """
    dev = resolve_device(device)
    key, parts = _cache_key(dev)
    path = cache_dir() / _CACHE_FILE
    sizes = {"bandwidth_nbytes": int(nbytes), "matmul_n": int(n), "matmul_dtype": "float32"}
    with _CACHE_LOCK:
        data = _read_cache(path)
        entry = data.get(key)
        why: list[str] = []
        previous = None
        if (
            isinstance(entry, dict)
            and all(entry.get(k) == v for k, v in sizes.items())
            and isinstance(entry.get("bandwidth_gbs"), (int, float))
            and isinstance(entry.get("matmul_gflops"), (int, float))
        ):
            why = ["refresh requested"] if refresh else _peak_problems(entry, max_age_days, busy_retry_s,
                                                                       min_bandwidth_gbs)
            if not why:
                return {**entry, "key": key, "source": "cache", "cache_file": str(path), "remeasured_because": []}
            previous = {k: entry.get(k) for k in ("bandwidth_gbs", "matmul_gflops", "measured_at", "busy",
                                                  "host_others_share", "steps_reached_gbs")}

        entry = {
            **parts,
            **sizes,
            "repeats": int(repeats),
            **_measure_peaks(dev, int(nbytes), int(n), int(repeats), busy_share),
            "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        seen = max([x for x in (min_bandwidth_gbs, (previous or {}).get("steps_reached_gbs")) if x] or [0.0])
        if seen > entry["bandwidth_gbs"]:
            entry["steps_reached_gbs"] = float(seen)     # steps here beat the copy: no re-measure for that again
        result = {**entry, "key": key, "source": "measured", "cache_file": str(path), "remeasured_because": why}
        if previous is not None:
            result["previous"] = previous
        data = _read_cache(path)  # re-read: another process may have written meanwhile
        data[key] = entry
        try:
            _write_cache(path, data)
        except OSError as exc:  # read-only home etc.: still return the figures
            result["cache_error"] = str(exc)
        return result
