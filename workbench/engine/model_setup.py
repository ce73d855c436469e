"""The model an engine runs: one device's LlamaModel, or tensor parallel's driver and its rank-0 shard."""
from __future__ import annotations

from .attention import resolve_choice
from .model import LlamaModel
from .stack import pool_pages


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
