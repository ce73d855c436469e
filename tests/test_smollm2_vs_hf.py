"""SmolLM2-135M end to end against Hugging Face transformers on the same GGUF weights."""
import torch

from hf_reference import hf_greedy
from workbench import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged memory.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, in simple words a child would understand.",
    "Hi",
]


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)




def test_teacher_forced_logits_match(smollm2_engine, smollm2_hf):
    model, tok = smollm2_hf
    prompts = [chat_ids(tok, p) for p in PROMPTS[:4]] + [tok(PROMPTS[4])["input_ids"]]
    ours = smollm2_engine.score(prompts)
    for ids, lg in zip(prompts, ours):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        diff = (lg - ref).abs().max().item()
        assert diff < 1e-3, f"max abs logit diff {diff} on a {len(ids)}-token prompt"


def test_concurrent_greedy_matches_one_at_a_time(smollm2_engine, smollm2_hf):
    model, tok = smollm2_hf
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 4          # different lengths, packed together
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = smollm2_engine.generate(prompts, params)
    for ids, out in zip(prompts, outs):
        ref = hf_greedy(model, ids, 32)
        assert out.token_ids == ref, (tok.decode(out.token_ids), tok.decode(ref))
    assert "Paris" in outs[0].text
