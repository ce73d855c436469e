"""Every pool call names whose pages they are: requests, score()'s own sequences, a named reservation."""
from workbench import Engine, EngineConfig, SamplingParams, faults
from workbench.event_log import EventLog
from workbench.events import PagesAllocated, PagesFreed
from workbench.faults.pool_pressure import RESERVATION


def test_each_call_carries_its_owner_and_none_is_left_behind(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    log = EventLog(eng.bus)
    eng.score([[5, 6, 7] * 10, [9] * 20])                 # outside the scheduler: ids -1, -2
    with faults.inject(eng, "pool_pressure", usable=0.5):  # pages taken for no request
        pass
    n_alloc, n_freed = len(log.frame(PagesAllocated)), len(log.frame(PagesFreed))
    outs = eng.generate([[4, 5, 6] * 12, [8] * 30], SamplingParams(max_tokens=20, ignore_eos=True))
    alloc, freed = log.frame(PagesAllocated), log.frame(PagesFreed)
    assert list(alloc["request_id"][:n_alloc]) == [-1, -2, RESERVATION]
    assert list(freed["request_id"][:n_freed]) == [-1, -2, RESERVATION]
    # after them, only the requests themselves: nothing rides on a stale owner
    rids = {o.request_id for o in outs}
    assert set(alloc["request_id"][n_alloc:]) == rids and set(freed["request_id"][n_freed:]) == rids
