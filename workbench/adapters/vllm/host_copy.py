"""Device tensors to the host without blocking the stream: what the worker-side checks read.

A `.to("cpu")` of a CUDA or NPU tensor waits for the stream: every step, it would stall the
worker until the forward queued so far has run, and defeat vLLM's asynchronous scheduling.
HostCopies.take() instead copies each tensor with non_blocking=True into a pinned host buffer
of its own (reused from step to step, grown when a step is larger) and records an event on the
stream after the copies; the check is judged once the event has completed (Pending.ready(),
which only queries it), in practice at the next execution. Tensors already on the host (vLLM's
own `*_cpu` copies, everything on the CPU build) are copied at once: their check is not deferred.

The buffers are per name and a Pending holds them until judged: at most `depth` Pendings are
kept (a stream that never completes drops the oldest, counted in `dropped`), so a step is judged
from the bytes of its own copy, never a later step's.
"""
from __future__ import annotations

from collections import deque

import numpy as np


def _on_host(t) -> bool:
    return getattr(getattr(t, "device", None), "type", "cpu") == "cpu"


def host_buffer(shape, dtype):
    """An empty host tensor to copy a device tensor into without blocking: pinned where this torch
    has a pinned allocator, else pageable (a CPU-only torch; the copy then waits, but nothing here
    has a stream to wait for)."""
    import torch
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:
        return torch.empty(shape, dtype=dtype)


def to_host(t):
    """t copied to the host without blocking the stream (judge it once record_event's event has
    completed). A tensor on the host is returned as it is."""
    if _on_host(t):
        return t.detach()
    return host_buffer(t.shape, t.dtype).copy_(t.detach(), non_blocking=True)


def record_event(device):
    """An event on device's current stream (None where this torch has no event for it)."""
    import torch
    for make in (lambda: torch.Event(device=device),
                 lambda: getattr(torch, getattr(device, "type", "")).Event()):
        try:
            ev = make()
            ev.record()
            return ev
        except Exception:            # this torch has no event for the device (or none at all)
            continue
    return None


class Pending:
    """One step's copies: arrays once ready()."""

    def __init__(self, arrays: dict, event, payload, on_host: bool):
        self._arrays, self.event, self.payload = arrays, event, payload
        self.on_host = on_host          # every tensor was on the host: read already, nothing deferred

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def arrays(self) -> dict[str, np.ndarray | None]:
        return {k: (None if v is None else (v if isinstance(v, np.ndarray) else v.numpy()))
                for k, v in self._arrays.items()}


class HostCopies:
    def __init__(self, depth: int = 4):
        self.depth = depth
        self._free: dict[str, list] = {}      # name -> pinned buffers not held by a Pending
        self.pending: deque[Pending] = deque()
        self.copies = 0                       # device tensors copied without blocking
        self.dropped = 0

    def _buffer(self, name: str, like, n: int):
        pool = self._free.setdefault(name, [])
        for i, b in enumerate(pool):
            if b.dtype == like.dtype and b.numel() >= n:
                return pool.pop(i)[:n]
        return host_buffer(max(n, 1024), like.dtype)[:n]

    def take(self, tensors: dict, payload=None) -> Pending:
        """tensors: name -> (tensor, rows or None) | None. Returns the Pending (already ready when every
        tensor was on the host). Never waits for the device."""
        arrays, device = {}, None
        for name, spec in tensors.items():
            if spec is None:
                arrays[name] = None
                continue
            t, n = spec
            t = t.detach()
            if n is not None:
                t = t[:n]
            if _on_host(t):
                arrays[name] = np.array(t.numpy(), copy=True)      # vLLM reuses its host buffers
                continue
            flat = t.reshape(-1)
            buf = self._buffer(name, flat, flat.numel())
            buf.copy_(flat, non_blocking=True)
            arrays[name] = buf.view(t.shape)
            device = t.device
            self.copies += 1
        p = Pending(arrays, None if device is None else record_event(device), payload, device is None)
        if device is not None:
            self.pending.append(p)
            while len(self.pending) > self.depth:
                self.release(self.pending.popleft())
                self.dropped += 1
        return p

    def completed(self) -> list[Pending]:
        """The deferred Pendings whose copies have landed, oldest first (their buffers are reused
        after the caller has read them: call again only once done with the arrays)."""
        out = []
        while self.pending and self.pending[0].ready():
            out.append(self.pending.popleft())
        return out

    def release(self, p: Pending) -> None:
        """p's pinned buffers back to the free lists (once its arrays have been read)."""
        for name, v in p._arrays.items():
            if v is not None and not isinstance(v, np.ndarray):
                base = v._base if getattr(v, "_base", None) is not None else v
                self._free.setdefault(name, []).append(base.reshape(-1))
