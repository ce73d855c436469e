"""The PAGEDKV_* environment overrides: one table, one reader.

Every engine switch is an EngineConfig field; a variable here only overrides it. The Engine
applies the overrides once, when it is built (apply()), logs them and shows them in
engine.kernels: nothing is read from the environment per step. The rows without a field are
process-wide (where builds and measured peaks are cached, which CPU the loader believes it runs
on, whether a stand-in torch_npu may be installed); their readers ask value() for them.

A process-wide native build is also kept from loading when its variable says torch / python
(kernels/loader.py asks value() once per extension): a config field alone leaves the build loaded
and makes only that engine take the torch / Python path. The vLLM plugin's PAGEDKV_VLLM_* and
PAGEDKV_RECORD* settings are the plugin's own table (adapters/vllm/settings.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .config import (ATTENTION_BACKENDS, BF16_MODES, ConfigError, EngineConfig, HUGEPAGES, LINEAR_BACKENDS, POOL_OPS,
                     QUANT_LAYOUTS, TP_ALLREDUCE)

_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass(frozen=True)
class Var:
    name: str
    field: str | None                   # the EngineConfig field it overrides; None: process-wide
    values: tuple[str, ...] | None      # the allowed values; None: free text (a path, a device, a number)
    meaning: str
    default: object = None              # rows with a field: the field's default
    number: bool = False                # a positive number of seconds
    only_over_auto: bool = False        # overrides the field only where it is "auto" (an explicit device wins)

    @property
    def fallback(self):
        return _DEFAULTS[self.field] if self.field else self.default


TABLE: tuple[Var, ...] = (
    Var("PAGEDKV_ATTENTION", "attention_backend", ATTENTION_BACKENDS,
        "torch: the torch attention reference; the compiled CPU attention module is not loaded in this process"),
    Var("PAGEDKV_LINEAR", "linear_backend", LINEAR_BACKENDS,
        "torch: F.linear at every size (no skinny GEMM, no oneDNN); the skinny GEMM is not loaded"),
    Var("PAGEDKV_POOL", "pool_ops", POOL_OPS,
        "python: the page pool's and scheduler's Python loops; their C twins are not loaded"),
    Var("PAGEDKV_BF16", "bf16_mode", BF16_MODES,
        "native: bf16 GEMMs; storage: bf16 weights and KV computed in fp32 (auto: what the CPU has)"),
    Var("PAGEDKV_PROBE_KERNELS", None, ("compiled", "numpy"),
        "numpy: the probes' clean paths in numpy (the attention check, the page_table checks, the page write "
        "ledger's step, the packing checks); their C twins (probes/csrc/, listed in probes/compiled.py) are not loaded", "compiled"),
    Var("PAGEDKV_HUGEPAGES", "hugepages", HUGEPAGES, "off: the KV cache in 4 KiB pages (torch.zeros)"),
    Var("PAGEDKV_QUANT_LAYOUT", "quant_layout", QUANT_LAYOUTS,
        "off: float32 decode streams float32 weights, not a GGUF's Q4_1 / Q8_0 blocks"),
    Var("PAGEDKV_DEVICE", "device", None, "what device='auto' resolves to (cpu, cuda:0, npu:0); "
        "an explicit device is never overridden", only_over_auto=True),
    Var("PAGEDKV_TP_ALLREDUCE", "tp_allreduce", TP_ALLREDUCE,
        "tensor parallel all-reduce: shm (shared memory, one host), gloo, auto (shm where it applies)"),
    Var("PAGEDKV_TP_STARTUP_S", "tp_startup_s", None, "seconds the ranks may take to load and shard", number=True),
    Var("PAGEDKV_TP_TIMEOUT_S", "tp_timeout_s", None, "seconds a rank may take to answer a step", number=True),
    Var("PAGEDKV_NPU_DOUBLE", None, ("0", "1"),
        "1: without a real torch_npu, install the CPU double of its paged ops (a dry run of the npu path)", "0"),
    Var("PAGEDKV_EXTENSIONS_DIR", None, None,
        "the native builds' cache (default ~/.cache/pagedkv-workbench/torch_extensions)"),
    Var("PAGEDKV_CACHE_DIR", None, None,
        "the measured peak figures' cache (default ~/.cache/pagedkv-workbench)"),
    Var("PAGEDKV_MODEL_CACHE", None, None,
        "where decoded GGUF models and their tokenizers are kept (default ~/.cache/pagedkv-workbench/models); "
        "0: decode the GGUF every time"),
    Var("PAGEDKV_CPU_FEATURES", None, None,
        "fakes this CPU's feature flags for the loader, the oneDNN and bf16 decisions (tests: avx2,fma; "
        "none: no compiled kernel at all)"),
    Var("PAGEDKV_MARCH", None, None, "the -march the C++ kernels are compiled for (default native; x86-64-v3: a "
        "build every AVX2 + FMA host loads, and how an AVX-512 host tests an AVX2 one's kernels)"),
    Var("PAGEDKV_MACHINE", None, None, "fakes the machine the loader runs on (tests: aarch64: no x86 build loads)"),
)
BY_NAME = {v.name: v for v in TABLE}


def _read(var: Var, environ=None):
    """The variable's value, checked and converted; None where it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(var.name)
    if raw is None or not raw.strip():
        return None
    if var.number:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise ConfigError(f"{var.name}={raw!r}: expected a positive number of seconds")
        return seconds
    if var.values is None:
        return raw.strip()
    got = raw.strip().lower()
    if got not in var.values:
        raise ConfigError(f"{var.name}={raw!r}: expected one of {', '.join(var.values)}")
    return got


def overrides(environ=None) -> dict:
    """{EngineConfig field: value} for every field variable set in environ (default os.environ)."""
    out = {}
    for var in TABLE:
        if var.field is not None and (v := _read(var, environ)) is not None:
            out[var.field] = v
    return out


def value(name: str, environ=None):
    """The variable's value, else its default (the field's): for readers without an engine config."""
    var = BY_NAME[name]
    got = _read(var, environ)
    return var.fallback if got is None else got


def apply(config: EngineConfig, environ=None) -> tuple[EngineConfig, dict[str, str]]:
    """(config with the environment's overrides, {field: "VAR=value"} of each one applied)."""
    found = overrides(environ)
    changes, applied = {}, {}
    for var in TABLE:
        if var.field not in found or (var.only_over_auto and getattr(config, var.field) != "auto"):
            continue
        changes[var.field] = found[var.field]
        applied[var.field] = f"{var.name}={found[var.field]}"
    return (config.replace(**changes) if changes else config), applied


def source(applied: dict[str, str], field: str) -> str:
    """' (PAGEDKV_X=v)' where the environment set `field`, else '': for the reasons engine.kernels gives."""
    return f" ({applied[field]})" if field in applied else ""
