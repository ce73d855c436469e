"""Which bfloat16 path this CPU gets: "native" bf16 GEMMs, or bf16 storage computed in float32.

bfloat16 halves the bytes of the weights and the KV pages on every CPU; whether it also
runs faster GEMMs depends on the silicon. With avx512_bf16 or AMX, oneDNN's bf16 kernels
(fp32 accumulate) outrun its fp32 ones, and the engine computes in bf16 ("native").
Without them oneDNN emulates bf16 and a GEMM runs ~4.5x slower than in float32 (measured
here: 67 vs 305 GFLOP/s), so the engine keeps the weights and KV pages in bf16 and computes
in float32 ("storage"): the skinny GEMM widens bf16 weights in registers at decode sizes
(half the bytes streamed), large GEMMs widen a layer's weights once per call, and the KV
pages are widened as the attention kernels read them. The widening is exact, so the
results are those of a float32 model whose weights were rounded to bf16 once: within
bf16's tolerance of the float32 model, closer to it than bf16 arithmetic. The mode is
decided from the CPU; EngineConfig.bf16_mode="native"|"storage" (or PAGEDKV_BF16) forces one
(tests, A/B runs).
"""
from __future__ import annotations

import functools

import torch

from . import env
from .kernels import trials
from .kernels.cpu import cpu_features, faked_text

MODES = ("native", "storage")


def _hardware() -> tuple[bool, str]:
    """(native bf16 GEMMs on this CPU, what showed it). A CPU faked by PAGEDKV_CPU_FEATURES is judged by
    its flags alone (an AVX-512 host can then be an AVX2-only one)."""
    fake = faked_text()
    if fake is None:
        return _detected()
    return _verdict(_flags(), f"the CPU faked by PAGEDKV_CPU_FEATURES={fake!r}")


@functools.lru_cache(maxsize=None)
def _detected() -> tuple[bool, str]:
    have = []
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported")):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                have.append(name)
        except Exception:         # an older torch without the probe: read the flags instead
            pass
    return _verdict(have or _flags(), "the CPU")


def _flags() -> list[str]:
    return [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_features()]


def _verdict(have: list[str], cpu: str) -> tuple[bool, str]:
    if have:
        return True, f"{cpu} has {' and '.join(have)}"
    return False, f"{cpu} has neither avx512_bf16 nor AMX, so bf16 GEMMs would be emulated (~4.5x slower than fp32)"


def hardware_native() -> bool:
    """Whether this CPU has native bf16 GEMMs (avx512_bf16 or AMX), whatever bf16_mode says."""
    return _hardware()[0]


def _forced(setting: str | None) -> str:
    """EngineConfig.bf16_mode as given; None (a caller without a config): PAGEDKV_BF16's, else auto."""
    return env.value("PAGEDKV_BF16") if setting is None else setting


def mode(device: torch.device | str = "cpu", setting: str | None = None) -> str:
    """'native' or 'storage' for bfloat16 on this device (non-CPU devices: always native)."""
    if torch.device(device).type != "cpu":
        return "native"
    forced = _forced(setting)
    if forced in MODES:
        return forced
    return "native" if _native_auto()[0] else "storage"


def _native_auto() -> tuple[bool, str]:
    """Auto: native where the CPU has native bf16 GEMMs AND oneDNN's bf16 linear passed its trial
    (kernels/trials.py); otherwise float32 compute over bf16 storage, which runs everywhere."""
    hw, why = _hardware()
    if not hw:
        return False, why
    t = trials.onednn_linear(torch.bfloat16)
    return (True, why) if t.ok else (False, f"{why}, but oneDNN's bf16 linear {t.why}")


def compute_dtype(dtype: torch.dtype, device: torch.device | str = "cpu", setting: str | None = None) -> torch.dtype:
    """The dtype activations are computed in for a model stored in `dtype` on `device`."""
    if dtype == torch.bfloat16 and mode(device, setting) == "storage":
        return torch.float32
    return dtype


def describe(device: torch.device | str = "cpu", setting: str | None = None) -> str:
    """One line for `kvwb doctor` and the benchmarks: the mode and why."""
    m = mode(device, setting)
    forced = _forced(setting)
    why = f"bf16_mode={forced!r}" if forced in MODES else _native_auto()[1]
    if m == "native":
        return f"native: bf16 GEMMs with fp32 accumulate, bf16 KV pages ({why})"
    return (f"storage: bf16 weights and KV pages, computed in fp32 ({why}); "
            "results within bf16 tolerance of fp32")
