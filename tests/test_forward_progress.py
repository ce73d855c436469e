"""Issue 27 item 3 on our own engine: forward progress and request accounting through probes/.

forward_progress uses probes/progress.py's `stalled`, the function the vLLM plugin calls;
pool_accounting's waiting rule is the plugin's "a request that is not running holds no blocks".
The admission bug is planted through the fault catalogue (the same bug the plugin plants in
vLLM); the preemption bug is an ordinary one patched into the scheduler nobody was told about.
"""
import numpy as np
import pytest

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine.scheduler import Scheduler


def workload(eng):
    rng = np.random.default_rng(3)
    short = [rng.integers(3, 256, 10).tolist() for _ in range(2)]
    long = rng.integers(3, 256, 130).tolist()
    ids = [eng.add_request(p, SamplingParams(max_tokens=80, ignore_eos=True)) for p in short]
    ids.append(eng.add_request(long, SamplingParams(max_tokens=4, ignore_eos=True)))
    ids.append(eng.add_request(short[0][::-1], SamplingParams(max_tokens=4, ignore_eos=True)))
    return ids


def drive(eng, max_steps=400):
    out, error = {}, None
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        try:
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = list(o.token_ids)
        except RuntimeError as e:           # our engine stops on a hang with nothing running
            error = str(e)
            break
    return out, error


def test_a_request_refused_with_room_in_the_pool_is_stalled_naming_it_and_the_queue_behind(sharp_llama_dir):
    clean = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, max_num_batched_tokens=256))
    wb = Workbench(clean, log=False).attach("forward_progress", forward_progress={"after": 16})
    ids = workload(clean)
    done, err = drive(clean)
    assert err is None and sorted(done) == sorted(ids) and not wb.all_findings()

    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, max_num_batched_tokens=256))
    wb = Workbench(eng, log=False).attach("forward_progress", forward_progress={"after": 16})
    ids = workload(eng)
    with faults.inject(eng, "admission_refuses_long_prompts"):
        done, err = drive(eng)
    assert ids[2] not in done and "scheduler stalled" in (err or "")       # it really never ran: the hang
    found = {f.request_id: f for f in wb.all_findings() if f.kind == "stalled"}
    assert set(found) == {ids[2], ids[3]}, [f.message for f in wb.all_findings()]   # it, and the one behind it
    f = found[ids[2]]
    assert f.severity == "warn" and f.evidence["needs"] <= f.evidence["free_pages"] and f.evidence["running"] == 2
    assert f.evidence["waited"] >= 16 and f"request {ids[2]} has waited" in f.message


def test_a_preemption_that_keeps_the_pages_is_named_while_the_request_waits(sharp_llama_dir, monkeypatch):
    def run():
        eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=12, max_num_batched_tokens=64))
        wb = Workbench(eng, log=False).attach("pool_accounting", pool_accounting={"every": 1})
        rng = np.random.default_rng(7)
        ids = [eng.add_request(rng.integers(3, 256, 20).tolist(), SamplingParams(max_tokens=60, ignore_eos=True))
               for _ in range(4)]
        waiting_pages, error = 0, None
        for _ in range(600):
            if not eng.has_unfinished():
                break
            try:
                eng.step()
            except RuntimeError as e:          # kept pages relieve nothing: the next step finds a full pool
                error = str(e)
                break
            waiting_pages = max(waiting_pages, sum(len(s.pages) for s in eng.scheduler.waiting))
        waiting_pages = max(waiting_pages, sum(len(s.pages) for s in eng.scheduler.waiting))
        return eng, wb, ids, waiting_pages, error

    eng, wb, ids, waiting_pages, error = run()
    assert eng.scheduler.num_preemptions > 0 and waiting_pages == 0 and error is None
    assert not wb.findings_at_least("warn"), [f.message for f in wb.all_findings()]

    release = Scheduler._preempt

    def preempt_keeping_pages(self, seq):
        # the bug: the preemption path re-queues the request with its page list, freeing nothing
        pages, gens, hashes = seq.pages, seq.page_generations, seq.page_hashes
        self.kv.release = lambda s: None
        try:
            release(self, seq)
        finally:
            del self.kv.release
        seq.pages, seq.page_generations, seq.page_hashes = pages, gens, hashes

    monkeypatch.setattr(Scheduler, "_preempt", preempt_keeping_pages)
    eng, wb, ids, waiting_pages, error = run()
    assert waiting_pages > 0 and "scheduler stalled" in error         # waiting requests really held pages: a hang
    held = [f for f in wb.findings_at_least("error") if f.kind == "held-while-waiting"]
    assert held, [f.message for f in wb.all_findings()]
    f = held[0]
    victim = [s for s in eng.scheduler.waiting if s.request_id == f.request_id][0]
    assert f.request_id in ids and f.page == victim.pages[0] and "still holds" in f.message
    assert f.evidence["preemptions"] == victim.num_preemptions >= 1
