"""A tiny random-weight Llama as a safetensors directory vLLM loads: pools of 100k blocks fit here.

SmolLM2's K/V take ~23 KB a token; 100,000 blocks of 32 tokens would need ~74 GB. This model
(2 layers, 4 query heads and 2 KV heads of 32: grouped-query attention, so a head-map or
head-order bug shows) takes 512 B a token, 1.6 GB for the same pool, so the plugin's cost
can be measured at production pool sizes on this machine. Its steps are far shorter than a
real model's, which makes the plugin's share of a step a pessimistic bound. Written once by
transformers (random weights, SmolLM2's tokenizer files), reused while complete.

The hybrid variant (`hybrid=True`, `--hybrid`) makes layer 0 sliding-window attention (a window
of HYBRID_WINDOW tokens) and layer 1 full attention, through the config's `layer_types` as
Gemma 3 / Mistral-style models spell it: vLLM gives it two KV cache groups (SlidingWindowSpec
and FullAttentionSpec) sharing one block pool, and frees the sliding group's blocks as they
leave the window, mid-request. The sliding variant (`sliding=True`, `--sliding`) makes both layers
sliding-window: one SlidingWindowSpec group (a Mistral-7B-v0.1-like model). The chunked variant
(`chunked=True`, `--chunked`) is a Llama 4 text model of the same size: layer 0 chunked-local
attention with RoPE (chunks of HYBRID_WINDOW tokens), layer 1 global attention without RoPE, dense
MLPs (no experts). vLLM gives it a ChunkedLocalAttentionSpec group beside a FullAttentionSpec one
when VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1, and one FullAttentionSpec group (its
chunked layer still attends within its chunk) otherwise. Nothing is downloaded.

    .venv/bin/python -m workbench.adapters.vllm.tiny_model [--hybrid | --sliding | --chunked] [OUT]   # prints the dir
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .model_dir import DEFAULT_DIR, write_model_dir

DEFAULT_TINY_DIR = Path(os.environ.get("PAGEDKV_VLLM_TINY_DIR",
                                       Path(__file__).resolve().parents[3] / ".cache" / "vllm-tiny-model"))
DEFAULT_HYBRID_DIR = DEFAULT_TINY_DIR.with_name("vllm-hybrid-model")
DEFAULT_SLIDING_DIR = DEFAULT_TINY_DIR.with_name("vllm-sliding-model")
DEFAULT_CHUNKED_DIR = DEFAULT_TINY_DIR.with_name("vllm-chunked-model")
HYBRID_WINDOW = 64
_DONE = ".written-gqa"          # the marker names the shape: an older directory is written again
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json")


def write_tiny_model_dir(out: str | Path | None = None, hybrid: bool = False, sliding: bool = False,
                         chunked: bool = False) -> Path:
    out = Path(out or (DEFAULT_HYBRID_DIR if hybrid else DEFAULT_SLIDING_DIR if sliding else
                       DEFAULT_CHUNKED_DIR if chunked else DEFAULT_TINY_DIR))
    layers = (["sliding_attention", "full_attention"] if hybrid else ["sliding_attention"] * 2 if sliding else None)
    if (out / _DONE).exists():
        return out
    import torch
    src = write_model_dir(DEFAULT_DIR)               # for the tokenizer (and its vocabulary size)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=8192,
                 bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    if chunked:
        from transformers import Llama4ForCausalLM as Model, Llama4TextConfig
        # no_rope_layers: 1 = RoPE (and chunked-local), 0 = NoPE global; interleave_moe_layer_step 0: no experts
        cfg = Llama4TextConfig(**shape, intermediate_size_mlp=256, tie_word_embeddings=False,
                               attention_chunk_size=HYBRID_WINDOW, no_rope_layers=[1, 0], interleave_moe_layer_step=0,
                               moe_layers=[], num_local_experts=1, num_experts_per_tok=1, use_qk_norm=False)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM as Model
        cfg = LlamaConfig(**shape, tie_word_embeddings=True,
                          **({"layer_types": layers, "sliding_window": HYBRID_WINDOW} if layers else {}))
    torch.manual_seed(0)
    model = Model(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    (out / _DONE).write_text("ok\n")
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--hybrid", "--sliding", "--chunked")]
    print(write_tiny_model_dir(*(args[:1]), hybrid="--hybrid" in sys.argv[1:], sliding="--sliding" in sys.argv[1:],
                               chunked="--chunked" in sys.argv[1:]))
