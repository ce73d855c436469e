"""Time travel: the pool rebuilt from the event log equals the live pool at every step."""
import numpy as np

from workbench import Engine, EngineConfig, SamplingParams
from workbench.event_log import EventLog
from workbench.trace.timetravel import PoolState, TimeTravel


def test_state_at_equals_live_snapshots(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=24, max_num_seqs=6,
                                                              max_num_batched_tokens=96))
    log = EventLog(eng.bus)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, 40).tolist()           # two and a half pages of common prefix
    prompts = [shared + rng.integers(3, 256, int(rng.integers(2, 30))).tolist() for _ in range(6)]
    prompts += [rng.integers(3, 256, int(rng.integers(10, 60))).tolist() for _ in range(6)]
    live = {}
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=int(rng.integers(4, 30)), ignore_eos=True))
        if i % 3 == 2:                                   # arrivals spread over the run
            eng.step()
            live[eng.step_count] = PoolState.from_engine(eng)
    while eng.has_unfinished():
        eng.step()
        live[eng.step_count] = PoolState.from_engine(eng)
    assert eng.stats()["num_preemptions"] > 0 and eng.stats()["prefix_cache_hits"] > 0
    tt = TimeTravel(log, eng.num_pages, keyframe_every=5)
    seen_states = set()
    for step, want in live.items():
        got = tt.state_at(step)
        assert np.array_equal(got.ref, want.ref), step
        assert np.array_equal(got.cached, want.cached), step
        assert got.owner_sets() == want.owner_sets(), step
        seen_states.update(np.unique(got.states).tolist())
    assert seen_states == {0, 1, 2, 3}                    # free, cached, owned and shared all occurred
