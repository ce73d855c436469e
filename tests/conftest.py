import os

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _recordings_in_tmp(tmp_path_factory):
    """The vLLM plugin's flight recorder is on with the plugin: tests' vLLM processes (they inherit
    this environment) record under the test's temporary directory, not the user's cache."""
    if "PAGEDKV_RECORD_DIR" not in os.environ:
        os.environ["PAGEDKV_RECORD_DIR"] = str(tmp_path_factory.mktemp("recordings"))
    yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama written by transformers as a real HF directory (safetensors).

    Initialised at 0.5, not transformers' 0.02: at 0.02 attention barely moves the logits
    and greedy decoding repeats one token whatever the KV cache holds, so a test comparing
    outputs could not see a garbled page. At 0.5 the next token depends on the context."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sharp_llama_dir(tiny_llama_dir):
    """The tiny Llama (its greedy text depends on what attention reads)."""
    return tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict:
    """vLLM's tiny random-weight Llamas (workbench/adapters/vllm/tiny_model.py), written once a session
    by transformers in the vLLM environment: "plain" (2 layers of full attention), "hybrid" (a
    sliding-window layer and a full one: two KV cache groups), "sliding" (both sliding-window), "chunked"
    (a Llama 4 text model: a chunked-local layer and a global one)."""
    from workbench.adapters.vllm.driver import run_python
    from workbench.adapters.vllm.server import vllm_python
    if not vllm_python().exists():
        pytest.skip(f"no vLLM environment at {vllm_python()} (make vllm installs it)")
    out = tmp_path_factory.mktemp("vllm-models")
    code = ("import sys\nfrom workbench.adapters.vllm.tiny_model import write_tiny_model_dir as write\n"
            "for kind in ('plain', 'hybrid', 'sliding', 'chunked'):\n"
            "    write(f'{sys.argv[1]}/{kind}', hybrid=kind == 'hybrid', sliding=kind == 'sliding',\n"
            "          chunked=kind == 'chunked')\n")
    p = run_python(code, str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    return {kind: str(out / kind) for kind in ("plain", "hybrid", "sliding", "chunked")}


@pytest.fixture(scope="session")
def smollm2_path():
    from workbench.engine.weights import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """Hugging Face transformers' own LlamaForCausalLM from the same GGUF: the reference."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                             dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model, tok


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    from workbench import Engine, EngineConfig
    return Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=512))


def require_compiled(kernel, what: str):
    """A compiled module the tests exercise: skipped without a C++ compiler, or where a faked CPU
    (PAGEDKV_CPU_FEATURES, `make test-cpus`) refuses it; a failure where it should have loaded."""
    mod = kernel.get()
    if mod is None:
        import shutil
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip(f"no C++ compiler: {what} cannot build ({kernel.why()})")
        if os.environ.get("PAGEDKV_CPU_FEATURES") or os.environ.get("PAGEDKV_MACHINE"):
            pytest.skip(f"the faked CPU refuses {what}: {kernel.why()}")
        pytest.fail(f"{what} did not build: {kernel.why()}")
    return mod


@pytest.fixture(scope="module")
def skinny_kernel():
    """The compiled skinny GEMM; skipped without a compiler, a failure if it should have built."""
    from workbench.engine.kernels import SKINNY_GEMM
    return require_compiled(SKINNY_GEMM, "the skinny GEMM")
