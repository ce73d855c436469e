"""How soon the attention check catches each math bug of the test suite, over 20 seeds.

The bugs are tests/test_probe_attention.py's (each patches a real code path of the torch attention
backend or the batch builder); the model is the tests' sharp tiny Llama (its outputs depend on what
attention reads), the workload six staggered requests with chunked prefill. Per bug: how many of the
seeds caught it at `error`, and the steps from the bug's first effect to the finding (min, median,
max). Target: 20 of 20, max <= 64.

    .venv/bin/python benchmarks/attention_check_latency.py [--seeds 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_probe_attention import BUGS, engine, watched, workload  # noqa: E402


def tiny_llama() -> str:
    """conftest's sharp_llama_dir, written here (the benchmark runs outside pytest)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    torch.manual_seed(1234)
    path = tempfile.mkdtemp(prefix="sharp-llama-")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args(argv)
    path = tiny_llama()
    print("| bug | caught | steps to the finding: min | median | max |\n|---|---|---|---|---|")
    for bug in BUGS:
        steps = []
        for seed in range(a.seeds):
            eng = engine(path)
            wb, _ = watched(eng, seed)
            fired: list = []
            caught = lambda: any(f.probe == "attention" for f in wb.findings_at_least("error"))  # noqa: E731
            with pytest.MonkeyPatch.context() as mp:
                bug(eng, mp, fired)
                workload(eng, seed, until=caught)
            found = [f for f in wb.findings_at_least("error") if f.probe == "attention"]
            if found and fired:
                steps.append(found[0].step - max(1, min(fired)))
        got = f"{len(steps)}/{a.seeds}"
        if steps:
            print(f"| {bug.__name__} | {got} | {min(steps)} | {statistics.median(steps):g} | {max(steps)} |")
        else:
            print(f"| {bug.__name__} | {got} | - | - | - |")


if __name__ == "__main__":
    main()
