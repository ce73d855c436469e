"""The KV cache in transparent huge pages (2 MiB) on a CPU, asked for before it is first touched.

Why: a decode step reads each row's KV pages, scattered through the pool. With 4 KiB pages a
KV page of 32 tokens (24 KiB in fp32) spans 6 of them: 6 TLB entries, and 6 restarts of the
hardware prefetchers, which stop at every 4 KiB boundary. Measured here (2-core Zen 4, 30 layers,
24 rows of ~310 tokens, pages placed at random in a pool of 2048, the same kernel and bytes in
one process, interleaved): compiled decode attention 1.15x faster in fp32 pages, 1.14x in bf16.
The decode-sized weights gained nothing (~1.01x: their kernels prefetch a sequential stream), so
they stay where torch puts them.

torch has a switch for this (THP_MEM_ALLOC_ENABLE=1), but it is read once, at torch's first
allocation: before a notebook or a server imports us. So the cache is mapped here (anonymous
mmap, madvise(MADV_HUGEPAGE), then zeroed, as torch.zeros would). Same bytes, same values:
only the page size changes.

Linux with /sys/kernel/mm/transparent_hugepage/enabled set to "always" or "madvise"; elsewhere,
or with EngineConfig.hugepages="off" (PAGEDKV_HUGEPAGES=off), torch.zeros.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

from . import env

HUGE_PAGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_state: dict = {}


def _off(setting: str | None) -> bool:
    """EngineConfig.hugepages as given; None (a caller without a config): PAGEDKV_HUGEPAGES's."""
    return (env.value("PAGEDKV_HUGEPAGES") if setting is None else setting) == "off"


def enabled(setting: str | None = None) -> bool:
    if _off(setting):
        return False
    if "thp" not in _state:
        try:
            mode = _THP.read_text()
        except OSError:
            mode = ""
        _state["thp"] = hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)
    return _state["thp"]


def describe(setting: str | None = None) -> str:
    """One line for `kvwb doctor`."""
    if _off(setting):
        return "4 KiB pages (hugepages='off' or PAGEDKV_HUGEPAGES=off)"
    if enabled(setting):
        return "2 MiB transparent huge pages for the KV cache"
    return "4 KiB pages (transparent huge pages are off or absent on this system)"


def _buffer(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed, huge-page-advised memory as a uint8 tensor (the tensor keeps the map alive)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.zero_()        # fault it in now (2 MiB at a time), not inside the first decode steps
    return buf


def zeros(shape, dtype: torch.dtype, device: torch.device | str = "cpu", setting: str | None = None) -> torch.Tensor:
    """torch.zeros(shape, dtype), in huge pages where they apply (CPU, >= 2 MiB, enabled(setting))."""
    device = torch.device(device)
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not enabled(setting):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _buffer(nbytes).view(dtype).view(shape)

