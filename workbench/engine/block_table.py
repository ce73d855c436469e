"""The device block_tables tensor: one buffer, re-bound before every forward.

Each bind bumps a version and records a checksum of the rows, so a probe can compare
the table a kernel actually read with the one that is current (the stale_binding
failure: a refactor moved the re-bind after the kernel launch).
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
        self._host = torch.zeros(cap, dtype=torch.int32,
                                 pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = self._host if self.device.type == "cpu" else torch.zeros(
            cap, dtype=torch.int32, device=self.device)
        self.version = 0
        self.checksum = 0
        self.shape = (0, 0)

    def fill_host(self, page_lists: list[list[int]]) -> np.ndarray:
        """Write page lists into the host rows (zero padded); returns the [B, W] host view."""
        b = len(page_lists)
        w = max((len(p) for p in page_lists), default=0)
        w = max(w, 1)
        if b > self.max_num_seqs or w > self.max_pages_per_seq:
            raise ValueError(f"block table {b}x{w} exceeds {self.max_num_seqs}x{self.max_pages_per_seq}")
        host = self._host_np[: b * w].reshape(b, w)
        host.fill(0)
        for i, pages in enumerate(page_lists):
            host[i, : len(pages)] = pages
        return host

    def bind(self, host: np.ndarray) -> torch.Tensor:
        """Publish the host rows to the device buffer; the kernel reads what this returns."""
        b, w = host.shape
        n = b * w
        if self._dev is not self._host:
            self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self.version += 1
        self.checksum = zlib.crc32(host.tobytes())
        self.shape = (b, w)
        return self._dev[:n].view(b, w)

    def current(self) -> torch.Tensor:
        b, w = self.shape
        return self._dev[: b * w].view(b, w)

    @staticmethod
    def checksum_of(t: torch.Tensor) -> int:
        return zlib.crc32(t.detach().to("cpu").contiguous().numpy().tobytes())
