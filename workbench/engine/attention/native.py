"""Build and load the compiled CPU decode kernel (csrc/paged_decode.cpp), once per machine.

torch.utils.cpp_extension compiles it with the machine's g++ (20-60 s) into
$PAGEDKV_EXTENSIONS_DIR or ~/.cache/pagedkv-workbench/torch_extensions, rebuilt when the
source changes; later processes only load it (`make` builds it during setup). When there is no compiler, or PAGEDKV_ATTENTION=torch,
`kernel()` returns None and the engine keeps the pure-torch path: slower, same results.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
HEADERS = Path(__file__).parents[1] / "csrc"     # the shared headers (avx512_math.h, quant_layout.h)
SOURCES = [SOURCE, SOURCE.with_name("paged_prefill.cpp")]     # one module; the bindings are in SOURCE
_lock = threading.Lock()
_state: dict = {}


def build_dir() -> Path:
    env = os.environ.get("PAGEDKV_EXTENSIONS_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    d = Path(env) if env else Path(xdg) / "pagedkv-workbench" / "torch_extensions"
    d.mkdir(parents=True, exist_ok=True)
    return d


def kernel():
    """The loaded extension module, or None (with the reason in `unavailable_reason()`)."""
    if "module" in _state:               # the hot path (rms_norm every layer): no lock once loaded
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        if os.environ.get("PAGEDKV_ATTENTION", "auto") == "torch":
            mod, why = None, "PAGEDKV_ATTENTION=torch"
        else:
            mod, why = compile_extension("pagedkv_paged_decode", SOURCES, "compiled CPU attention")
        _state["module"], _state["why"] = mod, why
        return mod


def compile_extension(name: str, sources: list[Path], what: str):
    """(module, None) once built and loaded from build_dir(), or (None, why) with a warning."""
    try:
        from torch.utils.cpp_extension import load   # torch (and its libgomp) already loaded
        # torch rebuilds when a source or a flag changes, not a header: the headers' hash goes
        # into the flags, so an edited header cannot leave a stale build in the cache.
        h = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(HEADERS.glob("*.h")))).hexdigest()[:16]
        # 512-bit vectors: g++ prefers 256 on these cores, and the loops below are bound by
        # loads and FMAs, not by the clock drop that preference guards against.
        return load(name=name, sources=[str(x) for x in sources],
                    extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp",
                                  f"-DPAGEDKV_HEADERS_{h}"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir()), verbose=False), None
    except Exception as e:               # no compiler, no headers, ...: keep the torch path
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("%s unavailable (%s): using the torch path", what, why)
        return None, why


def _rows(x: torch.Tensor):
    """x as [tokens, everything else] when the compiled ops can read it (CPU float32, contiguous
    rows), else None."""
    x2 = x.reshape(x.shape[0], -1)
    ok = x2.dtype == torch.float32 and x2.device.type == "cpu" and x2.stride(-1) == 1
    return x2 if ok and kernel() is not None else None


def row_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over everything but the first axis, NaN-propagating: compiled on CPU float32 (one
    pass, no thread fork per small tensor), torch elsewhere."""
    x2 = _rows(x)
    return kernel().row_absmax(x2) if x2 is not None else x.reshape(x.shape[0], -1).abs().amax(dim=1)


def absmax(x: torch.Tensor) -> float:
    """max |x| as a float, NaN-propagating; compiled on CPU float32, torch elsewhere."""
    if x.numel() == 0:
        return 0.0
    x2 = _rows(x)
    return kernel().absmax(x2) if x2 is not None else float(x.abs().max())


def unavailable_reason() -> str | None:
    kernel()
    return _state.get("why")


def main() -> int:
    """Build the compiled CPU kernels now and say so (`make` runs this during setup, so no test
    pays the compile): decode attention here, the skinny GEMM (engine/skinny_gemm.py)."""
    import time
    t = time.perf_counter()
    if kernel() is None:
        print(f"compiled CPU decode attention: unavailable ({unavailable_reason()}); the torch path will run")
    else:
        print(f"compiled CPU decode attention: ready in {time.perf_counter() - t:.1f} s ({build_dir()})")
    from .. import skinny_gemm
    t = time.perf_counter()
    if skinny_gemm.kernel() is None:
        print(f"compiled skinny GEMM: unavailable ({skinny_gemm.unavailable_reason()}); oneDNN / F.linear will run")
    else:
        print(f"compiled skinny GEMM: ready in {time.perf_counter() - t:.1f} s")
    return 0
