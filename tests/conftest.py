import os

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama written by transformers as a real HF directory (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
