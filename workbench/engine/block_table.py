"""The device block_tables tensor: one buffer, re-bound before every forward.

The host page lists are staged in a host buffer (fill_host: a new *current* version),
then published to the device buffer the kernels read (bind). Both carry a version
and a checksum, so a probe can compare the table a kernel actually read with the one
that is current: the stale_binding failure, where a refactor moved the re-bind after
the kernel launch. The two buffers are distinct even on CPU, so that failure garbles
output here exactly as it did on the NPU.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_num_seqs: int, max_pages_per_seq: int, device: torch.device):
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.device = torch.device(device)
        cap = max_num_seqs * max_pages_per_seq
        self._host = torch.zeros(cap, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self.host_version = 0        # the table as the engine currently means it
        self.host_checksum = 0
        self.version = 0             # the table the device buffer holds (what kernels read)
        self.checksum = 0
        self.shape = (0, 0)

    def fill_host(self, page_lists: list[list[int]]) -> np.ndarray:
        """Stage page lists into host rows (zero padded); returns the [B, W] host view."""
        b = len(page_lists)
        w = max(max((len(p) for p in page_lists), default=0), 1)
        if b > self.max_num_seqs or w > self.max_pages_per_seq:
            raise ValueError(f"block table {b}x{w} exceeds {self.max_num_seqs}x{self.max_pages_per_seq}")
        host = self._host_np[: b * w].reshape(b, w)
        host.fill(0)
        for i, pages in enumerate(page_lists):
            host[i, : len(pages)] = pages
        self.host_version += 1
        self.host_checksum = zlib.crc32(host.tobytes())
        self._staged_shape = (b, w)
        return host

    def bind(self) -> torch.Tensor:
        """Publish the staged rows to the device buffer; kernels read what view() returns."""
        b, w = self._staged_shape
        n = b * w
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self.version, self.checksum = self.host_version, self.host_checksum
        self.shape = (b, w)
        return self.view()

    def view(self, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """The device buffer as [B, W] (the staged shape unless given)."""
        b, w = shape or self._staged_shape
        return self._dev[: b * w].view(b, w)

    def host_view(self) -> np.ndarray:
        """The staged host rows as [B, W] (what bind() publishes)."""
        b, w = self._staged_shape
        return self._host_np[: b * w].reshape(b, w)

    @property
    def is_stale(self) -> bool:
        return self.version != self.host_version

    @staticmethod
    def checksum_of(t: torch.Tensor) -> int:
        return zlib.crc32(t.detach().to("cpu").contiguous().numpy().tobytes())
