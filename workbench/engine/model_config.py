"""ModelConfig: the architecture facts the engine needs, read from a HF
config.json or from GGUF metadata.

Only the Llama family the engine implements (llama, qwen2) is accepted;
anything that would silently change the math (rope scaling, sliding window,
partial rotary, extra biases) is refused here rather than producing garbage
later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict (transformers 4.x or 5.x layout)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture (model_type) {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 nests rope settings in rope_parameters; 4.x used
        # top-level rope_theta plus rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or {}
        for kind in (rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")):
            if kind not in (None, "default"):
                raise ValueError(f"rope scaling {kind!r} is not supported (only default RoPE)")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ValueError("llama with attention_bias/mlp_bias (o_proj/mlp biases) is not supported")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", 2048 if arch == "llama" else 32768)
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config has no flag for it.
            attention_bias=arch == "qwen2",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: Iterable[str]) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values)
        and the GGUF tensor names (bias and output tensors are facts only the
        tensor list records)."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        names = set(tensor_names)

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none") or "rope_freqs.weight" in names:
            raise ValueError(f"rope scaling {scaling or 'rope_freqs'!r} is not supported (only default RoPE)")
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rot != head_dim:
            raise ValueError(f"partial rotary (rope.dimension_count={rot} < head_dim={head_dim}) is not supported")
        has_bias = any(n.endswith(".attn_q.bias") for n in names)
        if arch == "llama" and (has_bias or any(n.endswith(".attn_output.bias") for n in names)):
            raise ValueError("llama GGUF with attention biases is not supported")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else int(get("vocab_size"))
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=has_bias,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=_id_tuple(eos),
        )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _id_tuple(value: Any) -> tuple[int, ...]:
    """int | list | None -> de-duplicated tuple of ints, order kept."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(dict.fromkeys(int(v) for v in items if v is not None))
