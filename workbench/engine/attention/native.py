"""The compiled CPU attention kernels (csrc/paged_decode.cpp, paged_prefill.cpp) and their small helpers.

Built and loaded by the one loader (engine/kernels/): compiled once per machine with g++
(20-60 s; `make` builds it during setup) into a cache entry under $PAGEDKV_EXTENSIONS_DIR or
~/.cache/pagedkv-workbench/torch_extensions, keyed by the sources, compiler, torch and the CPU
features it was compiled for. No compiler, PAGEDKV_ATTENTION=torch, or a cached build for a CPU
feature this one lacks (refused, see unavailable_reason()): `kernel()` is None and the engine
keeps the pure-torch path: slower, same results.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..kernels import ATTENTION, build_dir  # noqa: F401  (build_dir: the old public name)

SOURCE = ATTENTION.spec.sources[0]
HEADERS = Path(__file__).parents[1] / "csrc"     # the shared headers (avx512_math.h, quant_layout.h)
SOURCES = list(ATTENTION.spec.sources)           # one module; the bindings are in SOURCE

# The loaded extension module, or None (with the reason in `unavailable_reason()`): after the first
# call one dict lookup (rms_norm calls it every layer).
kernel = ATTENTION.get
unavailable_reason = ATTENTION.why


def _rows(x: torch.Tensor):
    """x as [tokens, everything else] when the compiled ops can read it (CPU float32, contiguous
    rows), else None."""
    x2 = x.reshape(x.shape[0], -1)
    ok = x2.dtype == torch.float32 and x2.device.type == "cpu" and x2.stride(-1) == 1
    return x2 if ok and kernel() is not None else None


def row_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over everything but the first axis, NaN-propagating: compiled on CPU float32 (one
    vectorised pass, rows split over threads only when there are many; ~3x torch's abs + amax on a
    2048-token prefill's hidden state, ~2x on a decode's K), torch elsewhere."""
    x2 = _rows(x)
    return kernel().row_absmax(x2) if x2 is not None else x.reshape(x.shape[0], -1).abs().amax(dim=1)


def rows_absmax(xs: list) -> torch.Tensor:
    """[len(xs), R]: row_absmax of each of xs (tensors of R rows each), in one compiled call over all of
    them where they are CPU float32 (a decode forward's layers: no stack, no call per layer), else
    stacked and reduced by torch."""
    R, x0 = xs[0].shape[0], xs[0]
    k = kernel() if x0.dtype == torch.float32 and x0.device.type == "cpu" else None
    if k is not None:
        x2 = [x.reshape(R, -1) for x in xs]
        if all(x.dtype == torch.float32 and x.stride(-1) == 1 for x in x2):
            return k.rows_absmax(x2)
    return torch.stack([x.reshape(R, -1).abs().amax(dim=1) for x in xs])


def absmax_each(xs: list) -> list[float]:
    """max |x| of each of xs (tensors of the same rows), NaN-propagating, 0.0 for no rows: one
    rows_absmax pass over them all (a layer's K and V, or every layer's K of a decode)."""
    if xs[0].shape[0] == 0:
        return [0.0] * len(xs)
    return rows_absmax(xs).amax(1).tolist()


def absmax(x: torch.Tensor) -> float:
    """max |x| as a float, NaN-propagating; compiled on CPU float32 (one thread), torch elsewhere."""
    if x.numel() == 0:
        return 0.0
    x2 = _rows(x)
    return kernel().absmax(x2) if x2 is not None else float(x.abs().max())


def main() -> int:
    """Build the compiled CPU kernels now and say so (`make` runs this during setup, so no test
    pays the compile): decode attention here, the skinny GEMM (engine/skinny_gemm.py); each line
    names the cache entry and the CPU features it was compiled for."""
    import time

    from ..kernels.cache import read_manifest
    from ..kernels.cpu import SHOWN_FEATURES

    def built_for(k) -> str:
        have = set((read_manifest(k.entry()) or {}).get("cpu_features", ()))
        return " ".join(f for f in SHOWN_FEATURES if f in have) or "no AVX2 / AVX-512 / AMX"

    t = time.perf_counter()
    if kernel() is None:
        print(f"compiled CPU decode attention: unavailable ({unavailable_reason()}); the torch path will run")
    else:
        print(f"compiled CPU decode attention: ready in {time.perf_counter() - t:.1f} s ({ATTENTION.entry()}; "
              f"built for {built_for(ATTENTION)})")
    from .. import skinny_gemm
    t = time.perf_counter()
    if skinny_gemm.kernel() is None:
        print(f"compiled skinny GEMM: unavailable ({skinny_gemm.unavailable_reason()}); oneDNN / F.linear will run")
    else:
        print(f"compiled skinny GEMM: ready in {time.perf_counter() - t:.1f} s ({skinny_gemm.SKINNY_GEMM.entry()}; "
              f"built for {built_for(skinny_gemm.SKINNY_GEMM)})")
    return 0
