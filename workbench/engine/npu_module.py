"""Whether torch_npu is here: the real module (imported once), or the CPU double standing in.

The lowest rung of the device layer: it imports nothing of ours, so the device discovery
(device.py) and the double itself (attention/npu_double.py, which must never shadow a real
torch_npu) both ask it without importing each other.
"""
from __future__ import annotations

import sys

_real: list = []          # the one probe of the real torch_npu: [module or None]


def import_real_torch_npu():
    """The real torch_npu (never the CPU double), or None if it is absent or does not load."""
    if not _real:
        held = sys.modules.get("torch_npu")
        if getattr(held, "IS_DOUBLE", False):
            return None          # the double stands in (installed only where the real one failed)
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception:  # ImportError, OSError (no CANN), RuntimeError, ...
            torch_npu = None
        _real.append(torch_npu)
    return _real[0]


def double_installed() -> bool:
    return getattr(sys.modules.get("torch_npu"), "IS_DOUBLE", False)
