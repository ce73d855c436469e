"""The model an engine runs: one device's LlamaModel, or tensor parallel's driver and its rank-0 shard;
and the engine's settings that follow from its config and the model (device, dtypes, lengths)."""
from __future__ import annotations

import logging

import torch

from . import env
from .device import resolve_device
from .attention import resolve_choice
from .kv_cache import torch_dtype
from .model import LlamaModel
from .stack import kv_dtypes, pool_pages

log = logging.getLogger("workbench.engine")


def build_model(loaded, config, device, dtype, max_model_len: int):
    """(model, parallel driver or None, the model config the KV stack is built for)."""
    mc = loaded.config
    if config.tensor_parallel_size > 1:
        # The driver starts the worker ranks and holds rank 0's shard, whose forward runs the step
        # protocol (engine/parallel/); the stack is built for rank 0's heads.
        from .parallel import Driver
        parallel = Driver(loaded, config, device, dtype, max_model_len, pool_pages(config, mc))
        return parallel.model, parallel, parallel.shard_config
    # torch_npu's ops take the query in the cache's dtype: no fp32 compute over bf16 storage there.
    npu = resolve_choice(device.type, config.attention_backend) == "npu"
    model = LlamaModel(mc, loaded.state_dict, dtype, device, max_positions=max_model_len,
                       compute_dtype=dtype if npu else None, quantized=loaded.quantized, switches=config)
    return model, None, mc


def configure(eng, loaded, config):
    """Set eng's config (the PAGEDKV_* overrides applied once, engine/env.py: every part reads the
    config after this), device, dtypes, max_model_len, model and parallel driver; returns the model
    config the KV stack is built for."""
    config, eng.env_overrides = env.apply(config)
    if eng.env_overrides:
        log.info("environment overrides: %s", ", ".join(eng.env_overrides.values()))
    eng.config = config
    eng.model_config = mc = loaded.config
    eng.tokenizer, eng.source = loaded.tokenizer, loaded.source
    eng.device = resolve_device(config.device)
    if config.num_threads and eng.device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    eng.dtype = torch_dtype(config.dtype)
    eng.kv_dtype, eng.kv_scaled = kv_dtypes(config)   # fp16_scaled: fp16 pages with a scale each
    eng.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    eng.model, eng.parallel, stack_mc = build_model(loaded, config, eng.device, eng.dtype, eng.max_model_len)
    return stack_mc
