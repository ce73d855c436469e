"""Backend discovery and device facts: which device to run on, how to wait for
it, how much memory is in use, and what the hardware can do at best.

Ascend NPU (``torch_npu``) is the first-class target, then CUDA, then CPU.
``torch_npu`` is optional: it is imported lazily, inside a guard, and a broken
install (missing CANN libraries and the like) counts as "no NPU".

Peak figures (copy bandwidth, matmul throughput, measured and cached) are
engine/peaks.py, a layer above this one (it times the devices found here).

Environment variables (read through engine/env.py, whose table lists every PAGEDKV_* one):

``PAGEDKV_DEVICE``
    overrides what ``resolve_device("auto")`` picks (e.g. ``cpu`` to force CPU
    on a GPU box). An explicit device name is never overridden.
``PAGEDKV_NPU_DOUBLE``
    ``1``: where the real torch_npu does not import, ``_import_torch_npu()`` returns
    the CPU double of its paged ops (attention/npu_double.py), so
    ``EngineConfig(device="cpu", attention_backend="npu")`` dry-runs the npu path.
``PAGEDKV_CACHE_DIR``
    directory of the peak-figures cache: engine/peaks.py.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path
from typing import Any, Union

import torch

from . import config, env, npu_module

__all__ = [
    "DeviceLike",
    "npu_available",
    "npu_info",
    "available_devices",
    "resolve_device",
    "device_name",
    "synchronize",
    "supported_dtypes",
]

DeviceLike = Union[str, torch.device, None]

_DEVICE_TYPES = ("cpu", "cuda", "npu")
_CANDIDATE_DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------


# the real torch_npu, probed once (npu_module.py: below this module and the double both)
_import_real_torch_npu = npu_module.import_real_torch_npu


def _import_torch_npu():
    """The torch_npu module: the real one; else the CPU double of its paged ops when it is
    installed or PAGEDKV_NPU_DOUBLE=1 (attention/npu_double.py; it has IS_DOUBLE and no
    devices); else None."""
    if npu_module.double_installed():
        return sys.modules["torch_npu"]
    real = _import_real_torch_npu()
    if real is not None or env.value("PAGEDKV_NPU_DOUBLE") != "1":
        return real
    from .attention import npu_double
    return npu_double.install()


def npu_available() -> bool:
    """True when torch_npu imports and reports at least one usable NPU."""
    if _import_torch_npu() is None:
        return False
    try:
        return bool(torch.npu.is_available()) and torch.npu.device_count() > 0  # type: ignore[attr-defined]
    except Exception:
        return False


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:
        return False


def _count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    if device_type == "cuda":
        return torch.cuda.device_count() if _cuda_available() else 0
    if device_type == "npu":
        return torch.npu.device_count() if npu_available() else 0  # type: ignore[attr-defined]
    return 0


def available_devices() -> list[str]:
    """Every device this process can use, e.g. ``["npu:0", "npu:1", "cpu"]``."""
    out: list[str] = []
    for kind in ("npu", "cuda"):
        out += [f"{kind}:{i}" for i in range(_count(kind))]
    out.append("cpu")
    return out


def _why_unavailable(kind: str) -> str:
    if kind == "cuda":
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is built without CUDA"
        return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    if kind == "npu":
        mod = _import_torch_npu()
        if mod is None:
            return "torch_npu is not installed or does not import (pip install 'pagedkv-workbench[npu]', source the CANN set_env.sh)"
        if getattr(mod, "IS_DOUBLE", False):
            return ("only the CPU double of torch_npu's paged ops is loaded (PAGEDKV_NPU_DOUBLE=1): no NPU; "
                    "device='cpu' with attention_backend='npu' runs the npu code path through it")
        return "torch_npu imports but sees no NPU (check ASCEND_RT_VISIBLE_DEVICES and npu-smi info)"
    return "unknown reason"


def _cann_version() -> tuple[str | None, str | None, str | None]:
    """(CANN version, the file it was read from, why not found). CANN records it in
    <home>/<arch>-linux/ascend_toolkit_install.info ("version=8.0.RC2") and, in toolkit installs,
    <home>/version.cfg ("toolkit_running_version=[7.6.0.1.220:8.0.0]"). <home> is what set_env.sh
    exports (ASCEND_TOOLKIT_HOME, ASCEND_HOME_PATH), else the default install paths."""
    homes = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    homes = [Path(h) for h in homes if h]
    if not homes:       # set_env.sh not sourced: the CANN a default install put where the docs say
        homes = [Path(b) / d for b in ("/usr/local/Ascend", Path.home() / "Ascend")
                 for d in ("ascend-toolkit/latest", "cann")]
    for home in homes:
        for info in sorted(home.glob("*-linux/ascend_toolkit_install.info")):
            try:
                for line in info.read_text(errors="replace").splitlines():
                    if line.strip().startswith("version="):
                        return line.split("=", 1)[1].strip(), str(info), None
            except OSError:
                continue
        cfg = home / "version.cfg"
        try:
            for line in cfg.read_text(errors="replace").splitlines():
                key, _, val = line.partition("=")
                if key.strip() in ("toolkit_running_version", "runtime_running_version") and ":" in val:
                    return val.strip().strip("[]").split(":", 1)[1], str(cfg), None
        except OSError:
            pass
    where = ", ".join(str(h) for h in homes)
    return None, None, f"no ascend_toolkit_install.info or version.cfg under {where} (source CANN's set_env.sh)"


def npu_info() -> dict[str, Any] | None:
    """The Ascend side, for ``kvwb doctor``: None when torch_npu does not import; otherwise
    ``torch_npu`` (its version), ``is_double`` (the CPU double of torch_npu, IS_DOUBLE),
    ``cann`` / ``cann_file`` (CANN's version and where it was read), ``available``,
    ``device_count``, ``device_name`` and ``hbm_bytes`` (of npu:0), and ``reasons``: for each
    fact that could not be had, why. Every call into the runtime is guarded: a broken driver is a
    reason, never a crash (doctor is what one runs when things are broken)."""
    try:
        torch_npu = _import_torch_npu()      # the real one, else the double (installed, or PAGEDKV_NPU_DOUBLE=1)
    except Exception:
        torch_npu = None
    if torch_npu is None:                    # what this process has loaded under the name, if anything
        torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return None
    reasons: dict[str, str] = {}

    def ask(what, fn, default=None):
        try:
            return fn()
        except Exception as e:       # AttributeError, RuntimeError from the driver, ...
            reasons[what] = f"{type(e).__name__}: {e}"
            return default

    info: dict[str, Any] = {
        "torch_npu": ask("torch_npu", lambda: str(torch_npu.__version__)),
        "is_double": ask("is_double", lambda: bool(getattr(torch_npu, "IS_DOUBLE", False)), False),
        "available": False, "device_count": 0, "device_name": None, "hbm_bytes": None,
    }
    info["cann"], info["cann_file"], why = ask("cann", _cann_version, (None, None, None))
    if why:
        reasons["cann"] = why
    npu = ask("device", lambda: getattr(torch, "npu", None) or getattr(torch_npu, "npu", None))
    if npu is None:
        reasons.setdefault("device", "the CPU double of torch_npu has no NPU" if info["is_double"]
                           else "torch.npu is missing: torch_npu did not register its device module")
    else:
        info["available"] = ask("available", lambda: bool(npu.is_available()), False)
        if info["available"]:
            info["device_count"] = ask("device_count", lambda: int(npu.device_count()), 0)
        elif "available" not in reasons:
            reasons["available"] = "torch.npu.is_available() is False (check ASCEND_RT_VISIBLE_DEVICES, npu-smi info)"
    if info["device_count"]:
        info["device_name"] = ask("device_name", lambda: str(npu.get_device_name(0)))
        info["hbm_bytes"] = ask("hbm_bytes", lambda: int(npu.get_device_properties(0).total_memory))
        if info["hbm_bytes"] is None:          # older torch_npu: the card's total from mem_get_info
            info["hbm_bytes"] = ask("hbm_bytes (mem_get_info)", lambda: int(npu.mem_get_info(0)[1]))
            if info["hbm_bytes"] is not None:
                reasons.pop("hbm_bytes", None)
    info["reasons"] = reasons
    return info


def resolve_device(name: DeviceLike = "auto") -> torch.device:
    """Turn a device name into a ``torch.device`` that is usable here.

    ``"auto"`` (or None) picks ``npu:0`` when torch_npu imports and an NPU is
    available, else ``cuda:0``, else ``cpu``; ``$PAGEDKV_DEVICE`` overrides it.
    Explicit names: ``cpu``, ``cuda``, ``cuda:N``, ``npu``, ``npu:N``, or a
    ``torch.device``. An unknown or unavailable device raises ValueError that
    lists what is available.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name is None:
        name = "auto"
    if not isinstance(name, str):
        raise TypeError(f"device must be a str or torch.device, not {type(name).__name__}")
    spec = name.strip().lower()

    if spec == "auto":
        override = env.value("PAGEDKV_DEVICE")        # the Engine applied it to its config already
        if override.lower() != "auto":
            return resolve_device(override)
        if npu_available():
            return torch.device("npu", 0)
        if _cuda_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")

    kind, _, idx_text = spec.partition(":")
    available = ", ".join(available_devices())
    if kind not in _DEVICE_TYPES:
        raise ValueError(
            f"unknown device {name!r}: expected 'auto', 'cpu', 'cuda[:N]' or 'npu[:N]'; "
            f"available here: {available}"
        )
    index: int | None = None
    if idx_text:
        if not idx_text.isdigit():
            raise ValueError(f"bad device index in {name!r}; available here: {available}")
        index = int(idx_text)
    if kind == "cpu":
        return torch.device("cpu")

    count = _count(kind)
    if count == 0:
        raise ValueError(
            f"device {name!r} is not available: {_why_unavailable(kind)}; available here: {available}"
        )
    if index is None:
        index = 0
    if index >= count:
        raise ValueError(
            f"device {name!r} is out of range: {count} {kind} device(s) visible; available here: {available}"
        )
    return torch.device(kind, index)


def device_name(device: DeviceLike = "auto") -> str:
    """A human name for the hardware: GPU/NPU model or the CPU model string."""
    dev = resolve_device(device)
    try:
        if dev.type == "cuda":
            return torch.cuda.get_device_name(dev)
        if dev.type == "npu":
            return str(torch.npu.get_device_name(dev.index or 0))  # type: ignore[attr-defined]
    except Exception:
        return dev.type
    return _cpu_model()


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# --------------------------------------------------------------------------
# sync and timing
# --------------------------------------------------------------------------


def synchronize(device: DeviceLike = "auto") -> None:
    """Wait until all queued work on ``device`` has finished (no-op on CPU)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "npu":
        torch.npu.synchronize(dev)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def _supported_dtypes(device_str: str) -> tuple[str, ...]:
    dev = torch.device(device_str)
    ok = []
    for name in _CANDIDATE_DTYPES:
        dt = getattr(torch, name)
        try:
            a = torch.ones(16, 16, device=dev, dtype=dt)
            c = a @ a
            synchronize(dev)
            if bool(torch.isfinite(c.float()).all()) and float(c[0, 0]) == 16.0:
                ok.append(name)
        except Exception:
            continue
    return tuple(ok)


def supported_dtypes(device: DeviceLike = "auto") -> list[str]:
    """Which of float32 / bfloat16 / float16 actually run a matmul on ``device``."""
    return list(_supported_dtypes(str(resolve_device(device))))


# EngineConfig refuses attention_backend="npu" where torch_npu's ops cannot run: it asks here (config.py)
config.npu_ops_available = lambda: _import_torch_npu() is not None
