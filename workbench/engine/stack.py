"""KVStack: the paged-KV parts that depend on the page size and the pool, built in one place.

Pool, KV manager, scheduler, batch builder, KV cache tensors and the attention backend
all follow from (EngineConfig, number of pages): build_stack() makes them together, for
the engine (with a model: cache tensors, builder, backend) and for the simulator
(without: pool, manager and scheduler only). Re-paging an engine is building another
stack and swapping it in (Engine.repage), never patching the parts one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import get_backend, resolve_choice
from .attention.base import AttentionBackend
from .batch import BatchBuilder
from .config import ConfigError, EngineConfig, check_npu, check_npu_head_size
from .kv_cache import KVCache, page_bytes, torch_dtype
from .kv_manager import KVCacheManager, pages_for
from .model_config import ModelConfig
from .pages import PagePool
from .scheduler import Scheduler

DEFAULT_NUM_PAGES = 2048


@dataclass
class KVStack:
    config: EngineConfig
    num_pages: int
    pool: PagePool
    kv_manager: KVCacheManager
    scheduler: Scheduler
    kv: KVCache | None = None              # None in simulate mode: no tensors
    builder: BatchBuilder | None = None
    attn: AttentionBackend | None = None

    @property
    def page_size(self) -> int:
        return self.config.page_size


def kv_dtypes(config: EngineConfig) -> tuple[torch.dtype, bool]:
    """(dtype of the KV pages, whether each page carries a scale: fp16_scaled)."""
    name = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    return torch_dtype("float16" if name == "fp16_scaled" else name), name == "fp16_scaled"


def pool_pages(config: EngineConfig, mc: ModelConfig | None) -> int:
    """Pages in the pool: num_pages, or as many as kv_cache_bytes holds for this model."""
    if config.kv_cache_bytes is None:
        return config.num_pages or DEFAULT_NUM_PAGES
    if mc is None:
        raise ConfigError("kv_cache_bytes needs a model to size pages from: give num_pages")
    dtype, _ = kv_dtypes(config)
    per_page = page_bytes(mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim, dtype)
    n = config.kv_cache_bytes // per_page
    if n < 1:
        raise ConfigError(f"kv_cache_bytes={config.kv_cache_bytes} holds no page (one page costs {per_page} bytes)")
    return n


def build_stack(config: EngineConfig, num_pages: int, mc: ModelConfig | None = None,
                device: torch.device | None = None, max_model_len: int | None = None) -> KVStack:
    """Every page-size-dependent part for num_pages pages; with a model config, its tensors too."""
    ps = config.page_size
    pool = PagePool(num_pages, ps, config.enable_prefix_caching, ops=config.pool_ops)
    kv_manager = KVCacheManager(pool, config.enable_prefix_caching)
    scheduler = Scheduler(kv_manager, config.max_num_seqs, config.max_num_batched_tokens, config.watermark,
                          ops=config.pool_ops)
    stack = KVStack(config, num_pages, pool, kv_manager, scheduler)
    if mc is not None:
        device = torch.device(device or "cpu")
        if resolve_choice(device.type, config.attention_backend) == "npu":
            check_npu(config)                   # "auto" on an NPU: known only now
            check_npu_head_size(mc.head_dim)    # the model's side of the ops' contract
        dtype, scaled = kv_dtypes(config)
        stack.kv = KVCache(mc.num_layers, num_pages, ps, mc.num_kv_heads, mc.head_dim, dtype, device, scaled=scaled,
                           hugepages=config.hugepages)
        stack.builder = BatchBuilder(config.max_num_batched_tokens, config.max_num_seqs,
                                     pages_for(max_model_len or mc.max_position_embeddings, ps), ps, device)
        stack.attn = get_backend(device.type, mc.num_heads, mc.num_kv_heads, mc.head_dim, page_size=ps,
                                 choice=config.attention_backend)
    return stack
