"""Issue 30, the core in vLLM's shape: Scheduler.schedule -> a runner's prepare / execute ->
Scheduler.update_from_output, for the engine and the simulator alike; request intake in its own module;
score() on pages the KV manager lends.

A bug planted in update_from_output shows in both the engine and the simulator (one bookkeeping path);
the runner computes and changes no request's state; bad input is rejected at intake and the engine
carries on."""
import numpy as np
import pytest

from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine.model_runner import ModelRunner, ModelRunnerOutput
from workbench.engine.outputs import RequestRejected
from workbench.engine.pages import NoFreePages
from workbench.engine.scheduler import Scheduler
from workbench.engine.step import drain_inbox
from workbench.trace.simulate import CostModelRunner, Simulator


def prompts(n=5, seed=2):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(10, 40, n)]


def run_sim(cfg, n=5):
    sim = Simulator(cfg)
    for p in prompts(n):
        sim.add_request(len(p), 12)
    done = []
    while sim.has_unfinished():
        sim.step()
        done += sim.last_finished
    return sim, done


def test_one_bookkeeping_path_drives_the_engine_and_the_simulator(tiny_llama_dir, monkeypatch):
    cfg = EngineConfig(num_pages=64)
    eng = Engine.from_pretrained(tiny_llama_dir, cfg)
    clean = [o.token_ids for o in eng.generate(prompts(), SamplingParams(max_tokens=12, ignore_eos=True))]
    _, sim_done = run_sim(cfg)
    assert len(clean) == len(sim_done) == 5 and all(len(t) == 12 for t in clean)
    assert all(s.num_output_tokens == 12 for s in sim_done)

    calls = {"engine": 0, "simulator": 0}
    real = Scheduler.update_from_output

    def off_by_one(self, sched, out, now, eos_token_ids=frozenset()):
        # a planted bug: every scheduled sequence is credited one token it never computed
        calls["simulator" if out.tokens is None else "engine"] += 1
        for seq, n in sched.scheduled:
            if seq.num_computed_tokens + n < seq.num_tokens:
                seq.num_computed_tokens += 1
        return real(self, sched, out, now, eos_token_ids)

    monkeypatch.setattr(Scheduler, "update_from_output", off_by_one)
    eng2 = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, max_num_batched_tokens=16))
    bad = [o.token_ids for o in eng2.generate(prompts(), SamplingParams(max_tokens=12, ignore_eos=True))]
    sim, _ = run_sim(EngineConfig(num_pages=64, max_num_batched_tokens=16))
    assert calls["engine"] == eng2.step_count and calls["simulator"] == sim.step_count   # every step, both
    assert bad != clean                                       # the engine's output really changed: skipped rows
    ref_sim, _ = run_sim(EngineConfig(num_pages=64, max_num_batched_tokens=16))
    monkeypatch.setattr(Scheduler, "update_from_output", real)
    ref_sim, _ = run_sim(EngineConfig(num_pages=64, max_num_batched_tokens=16))
    assert sim.step_count < ref_sim.step_count                # and the simulator's schedule too (fewer steps)


def test_the_runner_computes_and_the_scheduler_applies(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    assert isinstance(eng.runner, ModelRunner)
    eng.add_request(prompts(1)[0], SamplingParams(max_tokens=3, logprobs=2))
    drain_inbox(eng)
    sched = eng.scheduler.schedule()
    batch = eng.runner.prepare(sched)
    seq = sched.scheduled[0][0]
    out = eng.runner.execute(sched, batch)
    assert isinstance(out, ModelRunnerOutput) and out.sampled == [seq] and len(out.tokens) == 1
    assert seq.num_computed_tokens == 0 and seq.output_token_ids == [] and seq.logprobs == []   # nothing applied yet
    produced, finished = eng.scheduler.update_from_output(sched, out, 0.0)
    assert produced == [seq] and finished == [] and seq.output_token_ids == out.tokens
    assert seq.num_computed_tokens == seq.num_prompt_tokens and len(seq.logprobs) == 1
    # the simulator's cost model answers the same two calls: its input the step's token count, no
    # tokens out, a step time
    cost = CostModelRunner(Simulator(EngineConfig(num_pages=8)).cost)
    assert cost.prepare(sched) == seq.num_prompt_tokens
    o = cost.execute(sched, cost.prepare(sched))
    assert o.tokens is None and o.seconds == cost.cost(seq.num_prompt_tokens) > 0


def test_intake_rejects_bad_prompts_and_the_engine_carries_on(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    seen = []
    from workbench.events import RequestRejected as Rejected
    eng.bus.subscribe(Rejected, seen.append)
    for bad, match in [([1, 2, 300], "prompt token 2 is 300"), ([1, -1], "prompt token 1 is -1"),
                       ([], "empty"), (3.5, "not float"), ([1, True], "prompt token 1 is True")]:
        with pytest.raises(RequestRejected, match=match):
            eng.add_request(bad, SamplingParams(max_tokens=2))
    assert not eng.has_unfinished()
    out = eng.generate([prompts(1)[0]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and len(seen) == 5


def test_score_borrows_pages_from_the_kv_manager_and_gives_them_back(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=12, page_size=16))
    free = eng.pool.num_free
    logits = eng.score(prompts(3))
    assert [x.shape[0] for x in logits] == [len(p) for p in prompts(3)] and eng.pool.num_free == free
    too_many = [list(range(3, 150))] * 2                      # 2 x 10 pages > 12: refused, nothing leaked
    with pytest.raises(NoFreePages):
        eng.score(too_many)
    assert eng.pool.num_free == free
    assert len(eng.generate([prompts(1)[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
