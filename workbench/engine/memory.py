"""Time and memory on a device: a synchronizing timer, the host's and the device's memory in use.

Above the device discovery (device.py: which device, how to wait for it), below whatever measures:
the leak probe, `kvwb doctor`.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .device import DeviceLike, resolve_device, synchronize


class Timer:
    """Wall-clock timer that synchronizes the device at both ends.

    >>> with Timer("cpu") as t:
    ...     pass
    >>> t.seconds >= 0
    True
    """

    def __init__(self, device: DeviceLike = "auto") -> None:
        self.device = resolve_device(device)
        self.start_ns = 0
        self.elapsed_ns = 0

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self.start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.elapsed_ns = time.perf_counter_ns() - self.start_ns

    @property
    def seconds(self) -> float:
        return self.elapsed_ns / 1e9


# --------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------

_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "VmSwap": "swap_bytes"}


def host_memory_stats() -> dict[str, int]:
    """This process's resident memory: RSS, anonymous RSS and swap, in bytes.

    Read from ``/proc/self/status`` (Linux); elsewhere falls back to psutil's
    RSS with the other two reported as 0.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in _STATUS_FIELDS:
                    parts = rest.split()
                    value = int(parts[0])
                    unit = parts[1].lower() if len(parts) > 1 else "b"
                    out[_STATUS_FIELDS[key]] = value * 1024 if unit == "kb" else value
    except (OSError, ValueError, IndexError):
        out = {}
    if "rss_bytes" not in out:
        try:
            import psutil

            out["rss_bytes"] = int(psutil.Process().memory_info().rss)
        except Exception:
            out["rss_bytes"] = 0
    out.setdefault("rss_anon_bytes", 0)
    out.setdefault("swap_bytes", 0)
    return out


def memory_stats(device: DeviceLike = "auto") -> dict[str, Any]:
    """Memory in use, in bytes.

    Always: ``device`` and the host process figures ``rss_bytes``,
    ``rss_anon_bytes``, ``swap_bytes`` (on CPU these are the whole story).
    On cuda / npu also: ``allocated_bytes``, ``reserved_bytes``,
    ``max_allocated_bytes`` (caching allocator) and, where the backend tells,
    ``free_bytes`` / ``total_bytes`` of the card.
    """
    dev = resolve_device(device)
    stats: dict[str, Any] = {"device": str(dev)}
    stats.update(host_memory_stats())
    if dev.type in ("cuda", "npu"):
        mod = torch.cuda if dev.type == "cuda" else torch.npu  # type: ignore[attr-defined]
        stats["allocated_bytes"] = int(mod.memory_allocated(dev))
        stats["reserved_bytes"] = int(mod.memory_reserved(dev))
        stats["max_allocated_bytes"] = int(mod.max_memory_allocated(dev))
        try:
            free, total = mod.mem_get_info(dev)
            stats["free_bytes"], stats["total_bytes"] = int(free), int(total)
        except Exception:
            pass
    return stats


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------
