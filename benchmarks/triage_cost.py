"""What a divergence triage costs: 64 requests x 256 tokens, against one plain run of the same requests.

Two engines on the same weights that differ only numerically (page size 16 vs 64: every request comes
out drift or identical; nothing is localised), triage(a, b, prompts, max_tokens=256) timed phase by
phase (A greedy with log-probs, B teacher-forced, each side's repeat of a sample for the noise floor),
and, in the same run, the peer: A generating the same requests once, greedy, no log-probs. Printed:
the triage's wall time against the 60 s goal and its ratio to the plain run.

    .venv/bin/python benchmarks/triage_cost.py [--model smollm2|tiny] [--requests 64] [--tokens 256]
                                               [--forced decode|prefill]

--forced prefill times B teacher-forced through its prefill (EngineSide(forced="prefill"), prompt
log-probs) instead of its decode path: faster, and blind to faults of the decode path
(tests/test_prompt_logprobs.py); the bound printed is what a decode-path triage cannot beat here.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workbench import Engine, EngineConfig, SamplingParams  # noqa: E402
from workbench.diverge import EngineSide, triage  # noqa: E402


def engines(model: str, pages: int):
    if model == "smollm2":
        return (Engine.from_default(EngineConfig(num_pages=pages)),
                Engine.from_default(EngineConfig(num_pages=pages // 4, page_size=64)))
    from transformers import LlamaConfig, LlamaForCausalLM
    d = Path(tempfile.mkdtemp(prefix="kvwb-triage-llama-"))
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return (Engine.from_pretrained(d, EngineConfig(num_pages=pages)),
            Engine.from_pretrained(d, EngineConfig(num_pages=pages // 4, page_size=64)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="SmolLM2-135M (the default model) or a small random Llama (4 layers, hidden 256)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--forced", choices=EngineSide.PATHS, default="decode",
                    help="B's teacher forcing: through its decode path (the default) or its prefill")
    a = ap.parse_args(argv)
    A, B = engines(a.model, pages=4096)
    vocab = A.model_config.vocab_size
    rng = np.random.default_rng(0)
    pre = rng.integers(3, vocab, 32).tolist()                 # a shared system prompt, then each question
    prompts = [pre + rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(8, 64, a.requests)]
    A.generate(prompts[:4], SamplingParams(max_tokens=2))      # warm both: first-call costs are not triage's
    B.generate(prompts[:4], SamplingParams(max_tokens=2))

    t0 = time.perf_counter()
    A.generate(prompts, SamplingParams(max_tokens=a.tokens, ignore_eos=True))
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = triage(A, EngineSide(B, name="B", forced=a.forced), prompts, max_tokens=a.tokens)
    took = time.perf_counter() - t0

    print(f"model {a.model}, {a.requests} requests x {a.tokens} tokens, page size 16 vs 64 "
          f"({sum(len(p) for p in prompts)} prompt tokens), B forced through its {a.forced}")
    print(rep.summary())
    for phase, s in rep.seconds.items():
        print(f"  {phase:18s} {s:7.1f} s")
    print(f"triage: {took:.1f} s (goal < 60 s: {'met' if took < 60 else 'NOT met'}); "
          f"one plain greedy run of the same requests: {plain:.1f} s; ratio {took / plain:.2f}x")
    if a.forced == "decode":     # A's greedy run and B's forced one are each a decode pass: the bound
        print(f"two decode passes (the least a decode-path triage does): {2 * plain:.1f} s "
              f"({'under' if 2 * plain < 60 else 'over'} the goal before the noise floor)")


if __name__ == "__main__":
    main()
