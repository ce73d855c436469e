"""SamplingParams.prompt_logprobs: per prompt position, the log-prob of that prompt token and the top-k,
computed by the prefill that runs the prompt (vLLM's prompt_logprobs), and EngineSide(forced="prefill"),
the triage's teacher forcing through it.

Checked against transformers' dense forward, across prefill chunks that read earlier chunks' K/V from the
pages, past a prefix-cache hit (the cache may not serve a row that must be scored), and through a
preemption (the recompute overwrites, never appends). And the reason decode stays the triage's default:
a paged-KV fault that lives in the decode path corrupts the forced decode run and not the prefill one.
"""
import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, faults
from workbench.diverge import EngineSide, triage


def prompts(n=6, seed=5):
    rng = np.random.default_rng(seed)
    pre = rng.integers(3, 256, 40).tolist()
    return [pre + rng.integers(3, 256, int(k)).tolist() for k in rng.integers(20, 60, n)]


def reference(model, p):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)


@pytest.mark.parametrize("chunk", [2048, 24])
def test_prompt_logprobs_match_transformers_across_chunks_and_a_prefix_hit(tiny_llama_dir, tiny_hf_model, chunk):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, max_num_batched_tokens=chunk))
    ps = prompts()
    eng.generate(ps[:1], SamplingParams(max_tokens=2))            # the shared 40-token prefix now cached
    start = 20                                                    # score from position 20: inside the prefix
    outs = eng.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=4, prompt_logprobs_from=start))
    for p, o in zip(ps, outs):
        lp = reference(tiny_hf_model, p)
        assert len(o.prompt_logprobs) == len(p) - start
        want = lp[torch.arange(start - 1, len(p) - 1), torch.tensor(p[start:])].numpy()
        got = np.array([x[0] for x in o.prompt_logprobs])
        assert np.abs(got - want).max() < 1e-3, np.abs(got - want).max()
        assert [x[1][0] for x in o.prompt_logprobs] == lp[start - 1:len(p) - 1].argmax(-1).tolist()
        assert all(len(x[1]) == 4 for x in o.prompt_logprobs)
        assert o.num_cached_tokens <= start - 1                   # no scored row was served from the cache
    # without prompt_logprobs the same prompts do hit the cache past position 20
    assert max(o.num_cached_tokens for o in eng.generate(ps, SamplingParams(max_tokens=1))) >= 32
    with pytest.raises(ValueError, match="prompt_logprobs_from must be an int >= 1"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_from=0)
    from workbench.engine.outputs import RequestRejected
    with pytest.raises(RequestRejected, match="prompt_logprobs_from=50 leaves no prompt token to score in a prompt of 12"):
        eng.add_request(list(range(3, 15)), SamplingParams(prompt_logprobs=2, prompt_logprobs_from=50))
    assert not eng.has_unfinished()


def test_a_preempted_request_rescores_its_prompt_in_place(tiny_llama_dir, tiny_hf_model):
    """A pool too small for every request at once: preemption drops computed tokens, the recompute
    scores the same positions again; the list keeps one entry per position, each right."""
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=14, max_num_batched_tokens=32,
                                                              enable_prefix_caching=False))
    ps = prompts(6, seed=9)
    outs = eng.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2, prompt_logprobs_from=1))
    assert eng.stats()["num_preemptions"] > 0
    for p, o in zip(ps, outs):
        lp = reference(tiny_hf_model, p)
        got = np.array([x[0] for x in o.prompt_logprobs])
        want = lp[torch.arange(0, len(p) - 1), torch.tensor(p[1:])].numpy()
        assert len(got) == len(p) - 1 and np.abs(got - want).max() < 1e-3


def test_prefill_forcing_equals_decode_forcing_on_a_correct_engine(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=256, max_num_batched_tokens=32))
    ps = prompts()
    toks = [o.token_ids for o in eng.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))]
    dec = EngineSide(eng).run(ps, 16, forced=toks)
    pre = EngineSide(eng, forced="prefill").run(ps, 16, forced=toks)
    for i in range(len(ps)):
        assert pre.tokens[i] == toks[i] and pre.top[i].shape == dec.top[i].shape == (16, 5)
        assert np.abs(pre.logprob[i] - dec.logprob[i]).max() < 1e-3
        assert (pre.top[i][:, 0] == dec.top[i][:, 0]).all()
    with pytest.raises(ValueError, match="forced='sideways'"):
        EngineSide(eng, forced="sideways")


def test_a_decode_path_fault_shows_in_forced_decode_not_in_forced_prefill(sharp_llama_dir):
    """stale_binding (the block table bound after the kernel launch) garbles what decode reads once a
    sequence grows a page; teacher forcing through prefill never meets it. Why EngineSide forces
    through decode by default, at the price of a decode pass (README: the triage's cost)."""
    ps = prompts(8, seed=3)
    clean = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=256))
    verdicts = {}
    for path in ("decode", "prefill"):
        bad = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=256))
        with faults.inject(bad, "stale_binding") as f:
            rep = triage(clean, EngineSide(bad, name="B", forced=path), ps, max_tokens=24, localize=0)
            verdicts[path] = list(rep.frame().verdict)
        assert f.late_binds > 0                                   # the fault's seam really ran
    assert verdicts["decode"].count("corruption") >= 4, verdicts
    assert "corruption" not in verdicts["prefill"], verdicts


def test_prompt_logprobs_under_tensor_parallel_equal_one_device(tiny_llama_dir):
    """The prompt rows ride the step plan's logits_indices to every rank: TP=2 scores what TP=1 does."""
    ps = prompts(4, seed=11)
    sp = SamplingParams(max_tokens=2, prompt_logprobs=3, prompt_logprobs_from=5)
    one = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, max_num_batched_tokens=32)).generate(ps, sp)
    with Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, max_num_batched_tokens=32,
                                                             tensor_parallel_size=2)) as eng:
        two = eng.generate(ps, sp)
    for a, b in zip(one, two):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 0
        assert np.abs(np.array([x[0] for x in a.prompt_logprobs]) - np.array([x[0] for x in b.prompt_logprobs])).max() < 1e-4
        assert [x[1] for x in a.prompt_logprobs] == [x[1] for x in b.prompt_logprobs]
