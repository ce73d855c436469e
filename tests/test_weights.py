"""Weight loaders and tokenizer, checked against transformers on the same files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from workbench.engine.model_config import ModelConfig
from workbench.engine.tokenizer import Tokenizer
from workbench.engine.weights import default_model_path, expected_shapes, load_model

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥",
    "def f(x):\n    return x ** 2  # square\n\tprint(f'{x=}')",
    "  leading and trailing spaces  \n\n\nnewlines\t\ttabs   ",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_path):
    return smollm2_path


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):          # shared with the end-to-end tests (conftest)
    return smollm2_hf[0]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf):
    return smollm2_hf[1]


# ---------------------------------------------------------------- default GGUF


def test_default_gguf_config(ours, hf_model):
    c = ours.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (
        "llama", 30, 9, 3, 64, 576,
    )
    hc = hf_model.config
    assert c.vocab_size == hc.vocab_size
    assert c.intermediate_size == hc.intermediate_size
    assert c.rms_norm_eps == pytest.approx(hc.rms_norm_eps)
    assert c.rope_theta == pytest.approx(hc.rope_parameters["rope_theta"])
    assert c.max_position_embeddings == hc.max_position_embeddings
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert ours.meta["format"] == "gguf" and ours.meta["quant_types"]["Q4_1"] > 0


def test_default_gguf_state_dict_matches_transformers(ours, hf_model):
    ref = hf_model.state_dict()
    # transformers ties lm_head to the embedding; ours omits it when tied.
    assert set(ours.state_dict) == set(ref) - {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    for name, t in ours.state_dict.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert (t - ref[name]).abs().max().item() <= 1e-6, name


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers(ours, hf_tokenizer):
    tok = ours.tokenizer
    assert isinstance(tok, Tokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == ours.config.vocab_size == 49152
    # a second engine over the same file reuses the loaded tokenizer (5-15 s each otherwise)
    assert Tokenizer(tok.path).hf is tok.hf


def test_chat_template_matches_transformers(ours, hf_tokenizer):
    tok = ours.tokenizer
    for msgs in (MESSAGES, MESSAGES[1:2]):
        ids = tok.apply_chat_template(msgs)
        ref = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == list(ref)
        assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt == tok.apply_chat_template(MESSAGES)[: len(no_prompt)]


def test_a_gguf_tokenizer_is_kept_on_disk_and_read_back_the_same(gguf_path, hf_tokenizer, tmp_path, monkeypatch):
    from workbench.engine import tokenizer as tokenizer_module
    monkeypatch.setenv("PAGEDKV_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(tokenizer_module, "_LOADED", {})             # as a new process finds it
    entry = tokenizer_module.gguf_cache_entry(gguf_path)
    assert entry.parent == tmp_path and not entry.exists()
    built = Tokenizer(gguf_path)
    built.encode("x")
    assert (entry / "tokenizer.json").is_file()                      # rebuilt once, then written
    monkeypatch.setattr(tokenizer_module, "_LOADED", {})
    calls = []
    import transformers
    orig = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append((a, k)) or orig(*a, **k))
    read = Tokenizer(gguf_path)
    for text in TEXTS:                                               # the one read back is the reference's twin
        assert read.encode(text) == hf_tokenizer(text)["input_ids"] == built.encode(text), text
        assert read.decode(read.encode(text)) == text
    for msgs in (MESSAGES, MESSAGES[1:2]):
        assert read.apply_chat_template(msgs) == list(hf_tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert [a[0] for a, _ in calls] == [str(entry)] and "gguf_file" not in calls[0][1]   # from the entry
    # a cut-off entry is rebuilt from the GGUF, not trusted
    (entry / "tokenizer.json").write_text("{")
    monkeypatch.setattr(tokenizer_module, "_LOADED", {})
    again = Tokenizer(gguf_path)
    assert again.encode(TEXTS[0]) == hf_tokenizer(TEXTS[0])["input_ids"]
    assert calls[-1][1].get("gguf_file") == gguf_path.name and (entry / "tokenizer.json").stat().st_size > 1000


def test_a_decoded_gguf_is_kept_on_disk_and_read_back_bit_for_bit(gguf_path, tmp_path, monkeypatch):
    from workbench.engine import weights
    monkeypatch.setenv("PAGEDKV_MODEL_CACHE", str(tmp_path))
    entry = weights.gguf_cache_entry(gguf_path)
    assert entry.parent == tmp_path and not entry.exists()
    decoded = load_model(gguf_path)                                  # decodes, then writes the entry
    assert (entry / "model.json").is_file() and "read_from" not in decoded.meta
    decodes = []
    real = weights._load_gguf
    monkeypatch.setattr(weights, "_load_gguf", lambda *a: decodes.append(a) or real(*a))
    read = load_model(gguf_path)
    assert decodes == [] and read.meta["read_from"] == str(entry)
    assert read.config == decoded.config and set(read.state_dict) == set(decoded.state_dict)
    assert all(torch.equal(read.state_dict[k], v) for k, v in decoded.state_dict.items())
    assert set(read.quantized) == set(decoded.quantized) and all(
        q.qtype == decoded.quantized[k].qtype and np.array_equal(q.blocks, decoded.quantized[k].blocks)
        for k, q in read.quantized.items())
    assert load_model(gguf_path, torch.bfloat16).state_dict["model.norm.weight"].dtype == torch.bfloat16
    read.state_dict["model.norm.weight"].mul_(0)                     # a fault seam writing a weight in place
    assert torch.equal(load_model(gguf_path).state_dict["model.norm.weight"], decoded.state_dict["model.norm.weight"])
    # a damaged entry is decoded again; PAGEDKV_MODEL_CACHE=0 never reads one
    (entry / "tensors.safetensors").write_bytes(b"not safetensors")
    again = load_model(gguf_path)
    embed = "model.embed_tokens.weight"
    assert len(decodes) == 1 and torch.equal(again.state_dict[embed], decoded.state_dict[embed])
    monkeypatch.setenv("PAGEDKV_MODEL_CACHE", "0")
    assert "read_from" not in load_model(gguf_path).meta and len(decodes) == 2


# ---------------------------------------------------------------- HF directory


def _tiny(arch: str, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    Config, Model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=[2, 3],
    )
    cfg.rope_parameters = {"rope_theta": 5e5, "rope_type": "default"}
    torch.manual_seed(0)
    model = Model(cfg).eval()
    with torch.no_grad():  # init leaves norms at 1 and biases at 0: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


@pytest.mark.parametrize("arch,tie,shard", [("llama", False, False), ("qwen2", True, True)])
def test_hf_directory(tmp_path, arch, tie, shard):
    model = _tiny(arch, tie)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard

    m = load_model(tmp_path)
    c = m.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (arch, 256, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 5e5, 512)
    assert (c.tie_word_embeddings, c.attention_bias) == (tie, arch == "qwen2")
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2, 3))
    assert m.tokenizer is None and m.meta["format"] == "safetensors"

    ref = model.state_dict()
    assert set(m.state_dict) == set(ref) - ({"lm_head.weight"} if tie else set())
    assert set(m.state_dict) == set(expected_shapes(c))
    for name, t in m.state_dict.items():
        assert torch.equal(t, ref[name]), name


# ---------------------------------------------------------------- hand-written GGUF


def _write_gguf(path, arch: str, sd: dict[str, torch.Tensor], cfg: ModelConfig, qtype, q81: str = "") -> None:
    """A GGUF the way llama.cpp's converter writes one (q/k permuted for llama).
    q81: a tensor to store as Q8_1, a type gguf.quants cannot dequantize."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {v: k for k, v in {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }.items()}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for x in "qkv":
        layer[f"self_attn.{x}_proj.weight"] = f"attn_{x}.weight"
        layer[f"self_attn.{x}_proj.bias"] = f"attn_{x}.bias"
    for hf, t in sd.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model has no output.weight
        rest = ""
        if hf.startswith("model.layers."):
            i, rest = hf.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{i}.{layer[rest]}"
        else:
            name = names[hf]
        a = t.numpy().astype(np.float32)
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            n = cfg.num_heads if "q_proj" in rest else cfg.num_kv_heads  # llama.cpp's permute()
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if name == q81:
            w.add_tensor(name, np.zeros((a.shape[0], a.shape[1] // 32 * 40), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
# tol: worst-case error relative to the tensor's max |w|: half a quant step plus
# the fp16 rounding of the block scale (Q4_0 clips its top level: a whole step).
@pytest.mark.parametrize("qtype,tol", [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 1 / 200), ("Q4_0", 1 / 7), ("Q4_1", 1 / 12)])
def test_gguf_roundtrip(tmp_path, arch, qtype, tol):
    model = _tiny(arch, tie=False)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = ModelConfig.from_hf_config(model.config.to_dict())
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, ref, cfg, gguf.GGMLQuantizationType[qtype])

    m = load_model(path)
    assert m.config.architecture == arch and m.config.attention_bias == (arch == "qwen2")
    assert not m.config.tie_word_embeddings and m.config.vocab_size == 256
    assert set(m.state_dict) == set(ref)
    for name, t in m.state_dict.items():
        assert (t - ref[name]).abs().max().item() <= tol * ref[name].abs().max().item(), name


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_dtype_conversion(tmp_path, fmt):
    model = _tiny("qwen2", tie=True)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    if fmt == "gguf":
        path = tmp_path / "tiny.gguf"
        _write_gguf(path, "qwen2", ref, ModelConfig.from_hf_config(model.config.to_dict()), gguf.GGMLQuantizationType.F32)
    else:
        path = tmp_path
        model.save_pretrained(path)
    m = load_model(path, dtype=torch.bfloat16)
    for name, t in m.state_dict.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope.gguf")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(tmp_path)


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(p)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        load_model(tmp_path)
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(p)


def test_unsupported_quant_type(tmp_path):
    model = _tiny("llama", tie=True)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = ModelConfig.from_hf_config(model.config.to_dict())
    path = tmp_path / "q81.gguf"
    _write_gguf(path, "llama", ref, cfg, gguf.GGMLQuantizationType.F32, q81="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight uses GGML type Q8_1"):
        load_model(path)


def test_hf_directory_with_tokenizer(tmp_path, hf_tokenizer):
    _tiny("llama", tie=True).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    tok = load_model(tmp_path).tokenizer
    assert isinstance(tok, Tokenizer)
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tok.apply_chat_template(MESSAGES) == list(
        hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_no_safetensors(tmp_path):
    model = _tiny("llama", tie=True)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
