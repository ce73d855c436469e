"""EngineConfig: what the engine is asked to be, validated before anything is built.

Validation happens here, at start-up, because the failures it prevents are silent
later: a page size the kernels do not support falls back to a slow path (field
note 8), a pool sized from the wrong length wastes gigabytes (field note 10).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto",) + DTYPES + ("fp16_scaled",)
PAGE_TABLE_LOCKS = ("global", "sharded")


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
    # "global": one page-table lock for the step, every stream's table update and every
    # stats() reader (the lock_storm setup); "sharded": a lock per stream shard, stats()
    # from a snapshot published after each step (the fix, field note 6).
    page_table_lock: str = "global"
    # Escape hatch for the slow_page_size fault: production ran with page_size=12 for weeks.
    allow_unsupported_page_size: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        ps = self.page_size
        if not isinstance(ps, int) or isinstance(ps, bool):
            raise ConfigError(f"page_size must be an int, got {ps!r}; use 16, 32, 64 or 128")
        if not (_is_power_of_two(ps) and ps >= 16) and not self.allow_unsupported_page_size:
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

    def replace(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
