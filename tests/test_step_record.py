"""Issue 30, one observation contract: a typed StepRecord per step, made by our engine (engine/step.py)
and by the vLLM plugin's worker side (sanitizer.vllm_record), checked by one function
(probes/invariants.record_mismatches) that the packing probe and the plugin's sanitizer both call.

The reference half is compared with what the scheduler and the sequences hold, worked out here; a bug
planted in the real batch builder (its declared seam) changes the output and is named, with its request
and page, by the engine's probe and by the sanitizer's wording of the same record."""
import numpy as np
import pytest

from probes import invariants
from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.adapters.vllm import sanitizer
from workbench.engine.batch import BatchBuilder
from workbench.events import StepFinished
from workbench.step_record import StepRecord


def prompts(n=4, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(12, 40, n)]


def collect(eng):
    """Every step's record, frozen when the step ends (the next step reuses the builder's buffers)."""
    records = []
    eng.bus.subscribe(StepFinished, lambda e: records.append(eng.step_record.freeze()))
    return records


def test_each_step_records_the_schedule_and_the_sequences_own_state(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, page_size=16))
    ps = prompts()
    seen = {}

    def before_forward(batch):            # taken at the moment the model starts: the record must exist
        rec = eng.step_record
        seen[eng.step_count] = (rec is not None and rec.batch is batch, list(rec.computed),
                                [s.num_computed_tokens for s in batch.seqs])
    real = eng.runner.forward
    eng.runner.forward = lambda batch: (before_forward(batch), real(batch))[1]
    records = collect(eng)
    eng.generate(ps, SamplingParams(max_tokens=5, ignore_eos=True))
    assert records and all(isinstance(r, StepRecord) and r.source == "engine" for r in records)
    assert all(ok and comp == live for ok, comp, live in seen.values())     # made before the forward
    first = records[0]
    # step 1 prefills every prompt from 0: the scheduler's counts, the prompts' own lengths
    assert sorted(first.scheduled.tolist()) == sorted(len(p) for p in ps) and not first.computed.any()
    assert first.pages == [[*p] for p in first.pages] and all(len(p) == -(-n // 16)
                                                             for p, n in zip(first.pages, first.scheduled))
    later = records[2]                    # a decode step: one token each, after prompt + 1 sampled
    by_id = dict(zip(later.request_ids, later.computed.tolist()))
    assert later.scheduled.tolist() == [1] * later.num_rows
    assert all(by_id[rid] == len(ps[rid]) + 1 for rid in by_id)
    assert set(later.timings) == {"schedule", "prepare", "execute", "update"} and later.timings["execute"] > 0
    assert later.pool["free_after"] <= later.pool["free_before"] + 64
    for r in records:                     # a clean run: the one check finds nothing in any copy
        assert invariants.record_mismatches(r) == []
    frame = later.frame()
    assert list(frame.request_id) == later.request_ids and (frame.num_pages == [len(p) for p in later.pages]).all()


def test_a_planted_slot_bug_changes_the_output_and_both_consumers_name_it(tiny_llama_dir, monkeypatch):
    cfg = EngineConfig(num_pages=64, page_size=16)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    clean = [o.token_ids for o in Engine.from_pretrained(tiny_llama_dir, cfg).generate(prompts(), params)]

    target = 2
    real = BatchBuilder.build

    def build(self, scheduled, *a, **kw):      # the builder's declared seam: one request's decode K/V goes
        batch = real(self, scheduled, *a, **kw)    # over its first token's slot
        for i, s in enumerate(batch.seqs):
            if s.request_id == target and s.num_computed_tokens > 0:
                batch.slot_mapping[int(batch.cu_seqlens_q_np[i + 1]) - 1] = s.pages[0] * 16
        return batch
    monkeypatch.setattr(BatchBuilder, "build", build)
    eng = Engine.from_pretrained(tiny_llama_dir, cfg)
    wb = Workbench(eng).attach("packing")
    records = collect(eng)
    out = [o.token_ids for o in eng.generate(prompts(), params)]
    assert out[target] != clean[target]                      # the bug really changed what came out

    bad = [r for r in records if invariants.record_mismatches(r)]
    assert bad
    (m,) = invariants.record_mismatches(bad[0])
    assert m.check == "slot-mapping" and m.copy == "slot_mapping" and bad[0].request_ids[m.row] == target
    assert m.got == bad[0].pages[m.row][0] * 16 and m.want != m.got
    # the plugin's wording of the same kind of record names the request and the block the slot lies in
    (f,) = sanitizer.record_findings(bad[0])
    assert f["kind"] == "slot-mapping" and f["request_id"] == target and f["page"] == m.got // 16
    # and the engine's probe, reading the record during the forward, names request and page
    found = [x for x in wb.all_findings() if x.kind == "packing-slot-mapping"]
    assert found and {x.request_id for x in found} == {target}
    pos = bad[0].computed[m.row]
    assert found[0].page == bad[0].pages[m.row][pos // 16]


def test_the_vllm_record_is_the_same_type_and_the_same_check():
    # the sanitizer's hand-made batch (tests/test_vllm_sanitizer.py): three requests, block size 4
    rec = sanitizer.vllm_record(3, ["a", "b", "c"], [0, 9, 4], [6, 1, 5], [[3, 7], [5, 11, 2], [8, 9, 12, 13]], 4,
                                32, query_start_loc=np.array([0, 6, 7, 12]), seq_lens=np.array([6, 10, 9]),
                                block_table=np.array([[3, 7, 0], [5, 11, 2], [8, 9, 12]]),
                                slot_mapping=np.array([12, 13, 14, 15, 28, 29, 9, 36, 37, 38, 39, 48]),
                                positions=np.array([0, 1, 2, 3, 4, 5, 9, 4, 5, 6, 7, 8]))
    assert isinstance(rec, StepRecord) and rec.source == "vllm" and rec.batch is None and rec.plan is None
    assert invariants.record_mismatches(rec) == [] and sanitizer.record_findings(rec) == []
    rec.copies["seq_lens"] = ("ctx", np.array([6, 11, 9]))           # b's length one too long
    rec._arrays.clear()
    (m,) = invariants.record_mismatches(rec)
    assert (m.check, m.copy, rec.request_ids[m.row], m.got, m.want) == ("lengths", "seq_lens", "b", 11, 10)


def test_a_record_with_an_unknown_copy_kind_or_ragged_rows_is_refused():
    with pytest.raises(ValueError, match="unknown kind.*'seqlens'"):
        StepRecord(1, "engine", 16, 8, ["a"], [0], [3], [[1]], copies={"x": ("seqlens", [0, 3])})
    with pytest.raises(ValueError, match="2 request ids, 1 computed"):
        StepRecord(1, "engine", 16, 8, ["a", "b"], [0], [3, 1], [[1], [2]])
    with pytest.raises(ValueError, match="source"):
        StepRecord(1, "sglang", 16, 8, [], [], [], [])


def test_the_workbench_keeps_each_steps_phases_and_pool_counters(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, page_size=16))
    quiet = Workbench(eng, log=False)
    wb = Workbench(eng)
    steps = []
    eng.bus.subscribe(StepFinished, lambda e: steps.append((e.step, e.num_tokens)))
    eng.generate(prompts(), SamplingParams(max_tokens=5, ignore_eos=True))
    df = wb.steps()
    assert quiet.steps().empty                                  # kept only while the Workbench logs
    assert list(zip(df.step, df.tokens)) == steps               # one row per step, the tokens it ran
    assert (df[["schedule_ns", "prepare_ns", "execute_ns", "update_ns"]] > 0).all().all()
    assert (df.execute_ns > df.schedule_ns).all()               # the forward is where a step's time goes
    assert df.free_after.iloc[-1] == eng.pool.num_free          # the last step's pool, as the pool says
    assert (df.free_before.iloc[1:].to_numpy() == df.free_after.iloc[:-1].to_numpy()).all()
    wb.close()
    eng.generate(prompts(1), SamplingParams(max_tokens=2))
    assert len(wb.steps()) == len(df)                           # closed: no more rows
