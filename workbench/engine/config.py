"""EngineConfig: what the engine is asked to be, validated before anything is built.

Validation happens here, at start-up, because the failures it prevents are silent
later: a page size the kernels do not support falls back to a slow path (field
note 8), a pool sized from the wrong length wastes gigabytes (field note 10).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto",) + DTYPES + ("fp16_scaled",)
PAGE_TABLE_LOCKS = ("global", "sharded")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "npu")
LINEAR_BACKENDS = ("auto", "torch")
POOL_OPS = ("auto", "python")
BF16_MODES = ("auto", "native", "storage")
HUGEPAGES = ("auto", "off")
QUANT_LAYOUTS = ("auto", "off")
TP_ALLREDUCE = ("auto", "shm", "gloo")
# torch_npu's paged ops (attention/npu_double.py says where each limit is documented):
NPU_DTYPES = ("bfloat16", "float16")   # the paged ops' query / KV dtypes (no float32)
NPU_BLOCK_SIZE_MULTIPLE = 16  # _npu_paged_attention and the fused op: block_size % 16 == 0
NPU_BLOCK_SIZE_MAX = 512      # npu_fused_infer_attention_score PageAttention: block_size <= 512
NPU_HEAD_SIZE_MAX = 256       # _npu_paged_attention (ATB): head_size in (0, 256]


class ConfigError(ValueError):
    """A configuration value that the engine cannot run with; the message says what to use."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass
class EngineConfig:
    page_size: int = 16                   # tokens per KV page
    num_pages: int | None = None          # pages in the pool; or give kv_cache_bytes
    kv_cache_bytes: int | None = None     # KV memory budget; num_pages is derived from it
    max_num_seqs: int = 64                # sequences in one step
    max_num_batched_tokens: int = 2048    # token budget of one step (chunked prefill)
    max_model_len: int | None = None      # default: the model's context length
    dtype: str = "float32"                # weights and activations
    kv_cache_dtype: str = "auto"          # "auto" = dtype
    device: str = "auto"                  # auto: npu, then cuda, then cpu
    enable_prefix_caching: bool = True
    watermark: float = 0.01               # share of pages kept free at admission
    seed: int = 0
    num_threads: int | None = None        # torch intra-op threads on CPU (None: torch's default)
    capture_trace: str | None = None      # path of a JSONL file that records every arriving request
    # The flight recorder (workbench/recorder/): requests, page-pool events and steps in a bounded
    # ring of JSONL segments in this directory; record_privacy keeps prompt lengths and per-page
    # digests instead of token ids.
    record_dir: str | None = None
    record_max_bytes: int = 256 * 2**20
    record_privacy: bool = False
    # "global": one page-table lock for the step, every stream's table update and every
    # stats() reader (the lock_storm setup); "sharded": a lock per stream shard, stats()
    # from a snapshot published after each step (the fix, field note 6).
    page_table_lock: str = "global"
    # "auto": npu on an NPU device, else the compiled CPU kernel or the torch reference (as
    # get_backend picks); "torch" / "cpu" force one; "npu" on device="cpu" is the dry run of
    # the npu path through the CPU double of torch_npu's ops (PAGEDKV_NPU_DOUBLE=1).
    attention_backend: str = "auto"
    # Tensor parallelism over torch.distributed (gloo on CPU): attention and KV heads split across
    # this many ranks (whole GQA groups per rank, unevenly when they do not divide: see
    # workbench/engine/parallel/shard.py), rank 0 drives; 1 = one device, no process group.
    tensor_parallel_size: int = 1
    # Kernel and memory switches (engine/env.py: the PAGEDKV_* variable that overrides each).
    # "torch": F.linear at every size, no compiled skinny GEMM and no oneDNN prepacking.
    linear_backend: str = "auto"
    # "python": the page pool's and scheduler's Python loops, not their compiled C twins.
    pool_ops: str = "auto"
    # bfloat16 on a CPU: "native" bf16 GEMMs or "storage" (bf16 weights and KV computed in
    # float32); "auto": native where the CPU has avx512_bf16 or AMX (engine/cpu_bf16.py).
    bf16_mode: str = "auto"
    # "off": the KV cache in 4 KiB pages, not transparent huge pages (engine/hugepages.py).
    hugepages: str = "auto"
    # "off": float32 decode streams float32 weights, not a GGUF's own blocks (engine/quant_layout.py).
    quant_layout: str = "auto"
    # Tensor parallel: the all-reduce path ("shm": shared memory on one host, "gloo"), how long the
    # ranks may take to load and shard, and how long one may take to answer a step.
    tp_allreduce: str = "auto"
    tp_startup_s: float = 600.0
    tp_timeout_s: float = 120.0
    # Escape hatch for the slow_page_size fault: production ran with page_size=12 for weeks.
    allow_unsupported_page_size: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        ps = self.page_size
        if not isinstance(ps, int) or isinstance(ps, bool):
            raise ConfigError(f"page_size must be an int, got {ps!r}; use 16, 32, 64 or 128")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS}")
        # The npu backend's page-size rule is its ops' (a multiple of 16): check_npu, below.
        if not self.npu_attention and not (_is_power_of_two(ps) and ps >= 16) and not self.allow_unsupported_page_size:
            raise ConfigError(
                f"page_size={ps} is not a power of two >= 16: paged-attention kernels (Ascend "
                f"PagedAttention, FlashAttention) need one and silently fall back to a slow path "
                f"otherwise; use 16, 32, 64 or 128 (16 on CPU/CUDA, 128 recommended on Ascend)")
        if ps < 1:
            raise ConfigError(f"page_size must be >= 1, got {ps}")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ConfigError("give num_pages or kv_cache_bytes, not both "
                              f"(num_pages={self.num_pages}, kv_cache_bytes={self.kv_cache_bytes})")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            raise ConfigError(f"num_pages must be a positive int, got {self.num_pages!r}")
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int)
                                                or self.kv_cache_bytes < 1):
            raise ConfigError(f"kv_cache_bytes must be a positive int, got {self.kv_cache_bytes!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if not 0.0 <= self.watermark < 0.5:
            raise ConfigError(f"watermark={self.watermark} must be in [0, 0.5)")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ConfigError(f"num_threads must be a positive int, got {self.num_threads!r}")
        if self.page_table_lock not in PAGE_TABLE_LOCKS:
            raise ConfigError(f"page_table_lock={self.page_table_lock!r} is not one of {PAGE_TABLE_LOCKS}")
        if not isinstance(self.record_max_bytes, int) or self.record_max_bytes < 4096:
            raise ConfigError(f"record_max_bytes must be an int >= 4096, got {self.record_max_bytes!r}")
        for name, allowed in (("linear_backend", LINEAR_BACKENDS), ("pool_ops", POOL_OPS), ("bf16_mode", BF16_MODES),
                              ("hugepages", HUGEPAGES), ("quant_layout", QUANT_LAYOUTS),
                              ("tp_allreduce", TP_ALLREDUCE)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("tp_startup_s", "tp_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        if self.npu_attention:
            check_npu(self)

    @property
    def npu_attention(self) -> bool:
        """Whether the npu backend is asked for: by name, or "auto" on a device named npu (an NPU that
        device="auto" resolves to is known only at build: build_stack checks it then)."""
        backend = self.attention_backend
        return backend == "npu" or (backend == "auto" and str(self.device).startswith("npu"))

    def replace(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Whether torch_npu's ops can run here (the real module, or its CPU double installed or asked for with
# PAGEDKV_NPU_DOUBLE=1): answered by device.py, the layer that discovers devices, which sets this when
# it is imported (the engine package imports it before any EngineConfig is built). Config sits below
# the device layer and the environment table, so it asks through this seam instead of importing them.
npu_ops_available: Callable[[], bool] | None = None


def check_npu(cfg: EngineConfig) -> None:
    """The constraints torch_npu's paged ops document, for a config that runs the npu backend."""
    ps = cfg.page_size
    if not (ps % NPU_BLOCK_SIZE_MULTIPLE == 0 and 16 <= ps <= NPU_BLOCK_SIZE_MAX) and not cfg.allow_unsupported_page_size:
        raise ConfigError(
            f"page_size={ps} cannot run on the npu attention backend: torch_npu's paged ops take block_size a "
            f"multiple of 16 up to {NPU_BLOCK_SIZE_MAX} (_npu_paged_attention: % 16; npu_fused_infer_attention_"
            f"score: <= {NPU_BLOCK_SIZE_MAX}); use 128 (recommended, vllm-ascend's kernel block size) or 16, 32, 64")
    if cfg.dtype == "float32":
        raise ConfigError(
            "dtype='float32' cannot run on the npu attention backend: torch_npu's paged-attention ops take "
            "float16 / bfloat16 query and KV only; use dtype='bfloat16' (or 'float16'), or attention_backend='torch' "
            "for float32 through the torch reference")
    kv = cfg.kv_cache_dtype
    if kv == "fp16_scaled":
        raise ConfigError(
            "kv_cache_dtype='fp16_scaled' cannot run on the npu attention backend: the ops read the pages in "
            "place and take no per-page scale; use kv_cache_dtype='auto' with dtype='bfloat16' (bf16 has fp32's "
            "range: no 65504 overflow)")
    if kv not in ("auto", cfg.dtype):
        raise ConfigError(
            f"kv_cache_dtype={kv!r} with dtype={cfg.dtype!r} cannot run on the npu attention backend: the ops take "
            f"the query and the KV cache in one dtype (float16 or bfloat16); use kv_cache_dtype='auto'")
    if cfg.attention_backend == "npu" and not str(cfg.device).startswith("npu"):
        dev = str(cfg.device)
        if dev not in ("auto", "cpu") and not dev.startswith("npu"):
            raise ConfigError(f"attention_backend='npu' runs on an NPU, or on device='cpu' through the CPU double "
                              f"of torch_npu's ops; not on device={dev!r}")
        if npu_ops_available is not None and not npu_ops_available():
            raise ConfigError(
                "attention_backend='npu' needs torch_npu: install torch_npu (and CANN) to run on an Ascend NPU, or "
                "set PAGEDKV_NPU_DOUBLE=1 to dry-run the npu code path on the CPU through the contract-checking "
                "double of its ops (workbench/engine/attention/npu_double.py)")


def check_npu_head_size(head_dim: int) -> None:
    """The model side of the contract, known once the model config is."""
    if not 0 < head_dim <= NPU_HEAD_SIZE_MAX or head_dim % 16:
        raise ConfigError(
            f"head_dim={head_dim} cannot run on the npu attention backend: _npu_paged_attention takes head_size "
            f"in (0, {NPU_HEAD_SIZE_MAX}] and npu_fused_infer_attention_score a 16-aligned D; use "
            f"attention_backend='torch' for this model")
