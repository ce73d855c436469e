"""Replay: deterministic, simulate agrees with full on page accounting, sharing preserved."""
from pathlib import Path

import pytest

from workbench import Engine, EngineConfig
from workbench.trace import read_trace, replay

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_conversation" / "conversation_trace.jsonl"
AZURE = TRACES / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
pytestmark = pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/traces not present")

SIM = EngineConfig(page_size=16, num_pages=8192, max_num_seqs=64, max_num_batched_tokens=4096)


def test_same_trace_same_event_stream():
    t = read_trace(MOONCAKE)[:300]
    a = replay(t, SIM, "simulate", length_scale=1 / 8, progress=False)
    b = replay(t, SIM, "simulate", length_scale=1 / 8, progress=False)
    assert len(a.log) > 1000 and a.event_hash() == b.event_hash()
    c = replay(t, SIM, "simulate", length_scale=1 / 8, time_scale=0.5, progress=False)
    assert c.event_hash() != a.event_hash()          # the hash does see the schedule


def test_full_replay_is_deterministic(tiny_llama_dir):
    t = read_trace(AZURE)[:12]
    hashes = []
    for _ in range(2):
        eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=48, max_num_seqs=8))
        hashes.append(replay(t, eng, "full", length_scale=1 / 32, max_output_len=5, progress=False).event_hash())
    assert hashes[0] == hashes[1]


def test_simulate_and_full_agree_on_page_accounting(tiny_llama_dir):
    t = read_trace(AZURE)[:24]
    cfg = EngineConfig(num_pages=32, max_num_seqs=8, max_num_batched_tokens=256)
    kw = dict(length_scale=1 / 24, output_scale=4.0, max_output_len=80, time_scale=0.02, progress=False)
    full = replay(t, Engine.from_pretrained(tiny_llama_dir, cfg), "full", **kw)
    sim = replay(t, cfg, "simulate", **kw)
    cols = ["step", "num_tokens", "pages_used", "num_running", "num_waiting", "num_preemptions"]
    assert full.steps["num_preemptions"].iloc[-1] > 0          # the small pool did push back
    assert full.steps[cols].equals(sim.steps[cols])
    assert sorted(full.requests["output_len"]) == sorted(sim.requests["output_len"])


def test_mooncake_prefix_sharing_is_what_the_trace_says():
    t = read_trace(MOONCAKE)[:1500]
    # 512-token hash blocks scaled to 16 tokens = one page per block; a pool that never evicts
    cfg = EngineConfig(page_size=16, num_pages=60000, max_num_seqs=64, max_num_batched_tokens=8192)
    res = replay(t, cfg, "simulate", length_scale=1 / 32, progress=False)
    hit_blocks = (res.requests["num_cached_tokens"] // 16).sum()
    total_blocks = sum(len(r.hash_ids) for r in t)
    # a block that ends the prompt exactly is recomputed (the last token must be computed)
    seen, must_compute = set(), 0
    for r in t:
        plen = -(-r.prompt_len // 32)
        if all(h in seen for h in r.hash_ids) and plen % 16 == 0:
            must_compute += 1
        seen.update(r.hash_ids)
    assert res.engine.stats()["num_evictions"] == 0
    assert (hit_blocks + must_compute) / total_blocks == pytest.approx(t.repeated_block_fraction(), abs=2e-3)


def test_trace_package_exports_the_functions_not_modules():
    import types

    import workbench.trace as trace
    from workbench.trace import TimeTravel, advise, recommend, replay as fn
    from workbench.trace.advisor import advise as advise_mod
    from workbench.trace.replay import ReplayResult, replay as old_path     # the old module path still resolves
    from workbench.trace.timetravel import TimeTravel as tt_mod
    for name in ("replay", "TimeTravel", "advise", "recommend", "read_trace"):
        assert not isinstance(getattr(trace, name), types.ModuleType), name
    assert fn is old_path is trace.replay and callable(fn) and isinstance(TimeTravel, type)
    assert advise is advise_mod and TimeTravel is tt_mod and callable(recommend)
    assert ReplayResult.__module__ == "workbench.trace.replaying"


def test_simulated_replay_leaves_the_collector_as_it_was():
    import gc
    t = read_trace(MOONCAKE)[:20]
    assert gc.isenabled()
    replay(t, SIM, "simulate", length_scale=1 / 8, progress=False)
    assert gc.isenabled()
    gc.disable()
    try:
        replay(t, SIM, "simulate", length_scale=1 / 8, progress=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sim_page_keys_in_bulk_equal_page_key_one_by_one():
    import random

    from workbench.engine.sequence import SamplingParams
    from workbench.trace.simulate import SimSequence
    rng = random.Random(1)
    for _ in range(300):
        ps, block = rng.choice([4, 16, 32]), rng.choice([8, 16, 24, 48, 64, 512])
        plen = rng.randint(1, 400)
        ids = [rng.randint(0, 10 ** 9) for _ in range(-(-plen // block))] if rng.random() < 0.8 else None
        seq = SimSequence(rng.randint(0, 99), plen, SamplingParams(max_tokens=8), plen + 8, ids, block)
        a = rng.randint(0, (plen + 8) // ps)
        b = rng.randint(a, (plen + 8) // ps + 1)
        assert seq.page_keys(a, b, ps) == [seq.page_key(i, ps) for i in range(a, b)], (ps, block, plen, a, b)
