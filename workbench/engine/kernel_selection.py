"""KernelSelection: which attention, linear, pool-ops and bf16 path an engine runs, and why.

Decided once at engine start-up (engine/repage.py install, again when repage() builds a new stack) and
READ BACK from what was built: the attention backend object and whether it holds a compiled
kernel, the model's linears, the pool's and scheduler's loops, the model's compute dtype. So it
cannot disagree with what runs; the modules that make each choice (attention.get_backend,
linear.Linear, cpu_bf16.mode, the loader's switches) are the only deciders. `kvwb doctor`
prints the one a default engine would get (probe()), built from the same constructors. A reason
names the PAGEDKV_* variable where the environment set the field behind it (engine/env.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from . import env
from .kernels import trials
from .kernels.cpu import SHOWN_FEATURES, cpu_features, faked_text, machine
from .kernels.extensions import ATTENTION, POOL_OPS, SEQ_OPS, SKINNY_GEMM


@dataclass(frozen=True)
class KernelSelection:
    attention: str
    attention_why: str
    linear: str
    linear_why: str
    pool_ops: str
    pool_ops_why: str
    bf16: str
    bf16_why: str
    cpu: str
    overrides: str = ""             # the environment's overrides of the config, "PAGEDKV_X=v, ..."
    # every path this process tried on a tiny input (kernels/trials.py): "path: why; instead: fallback"
    refused: tuple[str, ...] = ()
    confirmed: tuple[str, ...] = ()

    def rows(self) -> list[tuple[str, str]]:
        return [("attention", f"{self.attention} ({self.attention_why})"),
                ("linear", f"{self.linear} ({self.linear_why})"),
                ("pool ops", f"{self.pool_ops} ({self.pool_ops_why})"),
                ("bf16", f"{self.bf16} ({self.bf16_why})"), ("cpu", self.cpu)] + (
                    [("env", self.overrides)] if self.overrides else []) + (
                    [("refused", r) for r in self.refused]) + (
                    [("confirmed", ", ".join(self.confirmed))] if self.confirmed else [])

    def short(self) -> str:
        """One line (the dashboard's header, logs)."""
        return f"attention {self.attention} · linear {self.linear} · pool ops {self.pool_ops} · bf16 {self.bf16}"

    def as_dict(self) -> dict:
        """JSON's shape (lists, not tuples): what `kvwb doctor --json` prints and reads back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        return "KernelSelection\n" + "\n".join(f"  {k + ':':<10} {v}" for k, v in self.rows())


def _attention(config, device: torch.device, attn, applied: dict) -> tuple[str, str]:
    from .attention import CpuPagedAttention, NpuPagedAttention, TorchFallbackAttention
    choice = f"attention_backend={config.attention_backend!r}{env.source(applied, 'attention_backend')}"
    # the CPU module is only loaded (maybe built) for a CPU engine, as rms_norm and get_backend do
    cpu_mod = ATTENTION.get() if device.type == "cpu" else None
    helpers = "; rms_norm (and RoPE + KV store where the cache takes it) compiled" if cpu_mod is not None else ""
    if isinstance(attn, CpuPagedAttention):
        if attn.kernel is None:
            return "cpu (no kernel: torch each step)", f"{choice}; {ATTENTION.why()}"
        return "cpu (compiled paged decode + prefill)", f"{choice}; {ATTENTION.entry()}"
    if isinstance(attn, TorchFallbackAttention):
        return attn.name, f"page_size={config.page_size}: no paged kernel takes it{helpers}"
    if isinstance(attn, NpuPagedAttention):
        return attn.name, f"{choice} on {device.type}: torch_npu's paged ops"
    if config.attention_backend == "torch":
        return attn.name, f"{choice}{helpers}"
    if device.type != "cpu":
        return attn.name, f"no compiled kernel for {device.type}"
    return attn.name, f"compiled kernel unavailable: {ATTENTION.why()}"


def _linear(config, device: torch.device, backend: str, applied: dict) -> tuple[str, str]:
    if config.linear_backend == "torch":
        return backend, f"linear_backend='torch'{env.source(applied, 'linear_backend')}: F.linear at every size"
    if backend.startswith("skinny"):
        rest = backend.split("+", 1)[1] if "+" in backend else "torch"
        return backend, f"compiled skinny GEMM at decode sizes, {rest} above; {SKINNY_GEMM.entry()}"
    if device.type != "cpu":
        return backend, f"{device.type}: torch's GEMMs"
    why = SKINNY_GEMM.why()
    if why:
        return backend, f"skinny GEMM unavailable: {why}"
    from . import skinny_gemm
    if skinny_gemm.for_linears() is None:                 # loaded, but only its portable loops
        return backend, "skinny GEMM not used: a build of its portable loops only, slower than oneDNN here"
    return backend, "the skinny GEMM did not agree with F.linear here"


def _pool(config, pool_impl, seq_impl, applied: dict) -> tuple[str, str]:
    names = {pool_impl.name, seq_impl.name}
    name = names.pop() if len(names) == 1 else f"pool {pool_impl.name}, seq {seq_impl.name}"
    if name == "compiled":
        return name, f"C loops; {POOL_OPS.entry()}"
    if config.pool_ops == "python":
        return name, f"pool_ops='python'{env.source(applied, 'pool_ops')}"
    why = POOL_OPS.why() or SEQ_OPS.why() or "the Python reference, chosen by the caller"
    return name, why


def _bf16(config, device: torch.device, weight_dtype, compute_dtype, attention_dtype, applied: dict) -> tuple[str, str]:
    from . import cpu_bf16, skinny_gemm
    said = cpu_bf16.describe(device, config.bf16_mode) + env.source(applied, "bf16_mode")
    if weight_dtype != torch.bfloat16:
        return "off", f"dtype={config.dtype!r}; bfloat16 here would be {said.split(':')[0]}"
    if device.type != "cpu":
        return "native", f"{device.type}: bf16 compute"
    if compute_dtype == torch.float32:
        return "storage", said.split(": ", 1)[1]
    pairs = "bf16 pair kernel (vdpbf16ps)" if skinny_gemm.bf16_pairs() else "no bf16 pair kernel"
    att = "unknown" if attention_dtype is None else str(attention_dtype).removeprefix("torch.")
    return "native", f"{said.split(': ', 1)[1]}; linears: {pairs}; attention rows {att}"


def _cpu() -> str:
    have = cpu_features()
    shown = [f for f in SHOWN_FEATURES if f in have]
    text = f"{machine()}: " + (" ".join(shown) if shown else "no AVX2 / AVX-512 / AMX flags")
    fake = faked_text()
    return text + (f" (faked: PAGEDKV_CPU_FEATURES={fake!r})" if fake is not None else "")


def _try_all() -> None:
    """Every CPU path tried (once per process, milliseconds), whether or not this engine takes it: what
    was refused is then the whole answer to "what can this CPU not do"."""
    from . import skinny_gemm
    from .attention.cpu_paged import prefill_bf16_dots
    for k in (ATTENTION, SKINNY_GEMM, POOL_OPS, SEQ_OPS):
        k.get()
    trials.onednn_linear(torch.float32), trials.onednn_linear(torch.bfloat16)
    skinny_gemm.bf16_pairs(), prefill_bf16_dots()


def select(config, device, attn, linear_backend: str, weight_dtype, compute_dtype, pool_impl, seq_impl,
           attention_dtype=None, applied: dict | None = None) -> KernelSelection:
    """applied: the environment's overrides of config ({field: "PAGEDKV_X=v"}, env.apply's)."""
    device, applied = torch.device(device), applied or {}
    if device.type == "cpu":
        _try_all()
    a, b, c, d = (_attention(config, device, attn, applied), _linear(config, device, linear_backend, applied),
                  _pool(config, pool_impl, seq_impl, applied),
                  _bf16(config, device, weight_dtype, compute_dtype, attention_dtype, applied))
    done = ([k.trial() for k in (ATTENTION, SKINNY_GEMM, POOL_OPS, SEQ_OPS)] if device.type == "cpu" else []
            ) + trials.done()
    return KernelSelection(*a, *b, *c, *d, cpu=_cpu(), overrides=", ".join(applied.values()),
                           refused=tuple(t.line() for t in done if not t.ok),
                           confirmed=tuple(t.path for t in done if t.ok))


def from_engine(engine) -> KernelSelection:
    """What this engine runs, read from its parts."""
    m = engine.model
    cache = engine.kv.k[0] if getattr(engine.kv, "k", None) else None
    adt = m.attention_dtype(engine.attn, cache) if hasattr(m, "attention_dtype") else None
    return select(engine.config, engine.device, engine.attn, getattr(m, "linear_backend", "unknown"),
                  getattr(m, "weight_dtype", engine.dtype), getattr(m, "dtype", engine.dtype),
                  engine.pool._ops, engine.scheduler._ops, adt, getattr(engine, "env_overrides", None))


def probe(config=None, device="cpu") -> KernelSelection:
    """What an engine with `config` would run on `device`, from the constructors an engine uses
    (get_backend, Linear, the pool's loops, cpu_bf16): `kvwb doctor` without loading a model."""
    from . import cpu_bf16, pool_ops, seq_ops
    from .attention import get_backend
    from .config import EngineConfig
    from .kv_cache import torch_dtype
    from .linear import Linear
    from .model import LlamaModel
    from .stack import kv_dtypes
    config, applied = env.apply(config or EngineConfig())        # as the Engine resolves its config
    device = torch.device(device)
    attn = get_backend(device.type, 4, 2, 64, page_size=config.page_size, choice=config.attention_backend)
    wdt = torch_dtype(config.dtype)
    cdt = cpu_bf16.compute_dtype(wdt, device, config.bf16_mode)
    lin = Linear(torch.randn(64, 64).to(device, wdt), compute_dtype=cdt, backend=config.linear_backend,
                 layout=config.quant_layout)
    # the model's own rule (LlamaModel.attention_dtype) over a two-page cache of the config's dtype
    cache = torch.zeros(2, config.page_size, 2, 64, dtype=kv_dtypes(config)[0], device=device)
    adt = LlamaModel.attention_dtype(SimpleNamespace(dtype=cdt, device=device), attn, cache)
    return select(config, device, attn, lin.backend, wdt, cdt, pool_ops.active(config.pool_ops),
                  seq_ops.active(config.pool_ops), adt, applied)
