"""The KV cache in 2 MiB pages (engine/hugepages.py): the same zeroed tensors, in huge pages
where the system allows them, and torch.zeros where it does not or when turned off."""
from __future__ import annotations

import pytest
import torch

from workbench.engine import hugepages
from workbench.engine.kv_cache import KVCache


def _huge_kib_of(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t (read from /proc/self/smaps, not from our code)."""
    addr = t.data_ptr()
    cur, huge = None, {}
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = (lo, hi)
        elif head == "AnonHugePages:" and cur is not None:
            huge[cur] = int(line.split()[1])
    return sum(kib for (lo, hi), kib in huge.items() if lo <= addr < hi)


def test_kv_cache_pages_are_zeroed_and_huge_where_the_system_allows():
    if not hugepages.enabled():
        pytest.skip("transparent huge pages are off or absent here")
    cache = KVCache(2, 256, 32, 3, 64, torch.float32, torch.device("cpu"))      # 6 MiB a layer
    k = cache.k[0]
    assert k.shape == (256, 32, 3, 64) and k.dtype == torch.float32 and k.is_contiguous()
    assert torch.count_nonzero(k).item() == 0 and torch.count_nonzero(cache.v[1]).item() == 0
    assert _huge_kib_of(k) >= 2048, "the kernel gave the cache no 2 MiB page"
    k[17, 3] = 1.5                                     # an ordinary writable tensor, own memory
    assert k[17, 3].eq(1.5).all() and torch.count_nonzero(cache.k[1]).item() == 0
    assert cache.k[0].data_ptr() != cache.k[1].data_ptr()


def test_small_caches_and_the_switch_keep_torch_zeros(monkeypatch):
    small = hugepages.zeros((4, 16, 2, 8), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and torch.count_nonzero(small).item() == 0
    monkeypatch.setenv("PAGEDKV_HUGEPAGES", "off")
    big = hugepages.zeros((256, 32, 3, 64), torch.float32)
    assert torch.count_nonzero(big).item() == 0 and _huge_kib_of(big) == 0
    assert "PAGEDKV_HUGEPAGES=off" in hugepages.describe()
