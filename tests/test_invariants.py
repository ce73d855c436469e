"""probes/invariants.py: the plain functions our probes (and the vLLM adapter) share."""
import numpy as np

from probes import invariants
from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.engine.attention.torch_ref import TorchPagedAttention
from workbench.engine.batch import BatchBuilder
from workbench.engine.sequence import Sequence


def _seqs(rng, n=5, ps=16):
    seqs, sched, next_page = [], [], 1
    for i in range(n):
        total = int(rng.integers(2, 120))
        done = int(rng.integers(0, total))
        q = int(rng.integers(1, total - done + 1))
        s = Sequence(i, rng.integers(3, 200, total).tolist(), SamplingParams(), max_len=total + 1)
        s.num_computed_tokens = done
        k = -(-(done + q) // ps)
        s.pages = list(range(next_page, next_page + k))[::-1]        # any order: the table is per sequence
        next_page += k
        seqs.append(s)
        sched.append((s, q))
    return seqs, sched


def test_reference_equals_what_the_builder_packs():
    rng = np.random.default_rng(0)
    for _ in range(20):
        seqs, sched = _seqs(rng)
        batch = BatchBuilder(2048, 8, 16, 16, "cpu").build(sched)
        ref = invariants.reference([s.num_computed_tokens for s in seqs], [n for _, n in sched],
                                   [s.pages for s in seqs], 16)
        assert (ref.positions == batch.positions.numpy()).all()
        assert (ref.slots == batch.slot_mapping.numpy()).all()
        assert (ref.cu_q == batch.cu_seqlens_q.numpy()).all() and (ref.cu_k == batch.cu_seqlens_k.numpy()).all()
        assert invariants.compare_table(batch.block_tables.numpy().astype(np.int64), ref) == []
        toks = invariants.tokens_at([s.token_ids for s in seqs], ref)
        assert (toks == batch.input_ids.numpy()).all()


def test_mismatches_name_the_row_and_entry():
    rng = np.random.default_rng(1)
    seqs, sched = _seqs(rng)
    ref = invariants.reference([s.num_computed_tokens for s in seqs], [n for _, n in sched],
                               [s.pages for s in seqs], 16)
    slots = ref.slots.copy()
    slots[ref.cu_q[3]] += 1                                  # first token of sequence 3
    cu = ref.cu_q.copy()
    cu[2] -= 1                                               # end of sequence 1
    found = invariants.packing_mismatches(ref, slot_mapping=slots, twins={"cu_seqlens_q_np": (cu, "cu_q"),
                                                                          "diff": (cu, "diff_q")})
    got = {(m.check, m.copy, m.row) for m in found}
    assert ("slot-mapping", "slot_mapping", 3) in got
    assert ("lengths", "cu_seqlens_q_np", 1) in got
    assert {("lengths", "diff", 1), ("lengths", "diff", 2)} <= got
    table = ref.table.copy()
    table[2, 0] += 1000
    [m] = invariants.compare_table(table, ref)
    assert (m.row, m.index, m.got, m.want) == (2, 0, ref.table[2, 0] + 1000, ref.table[2, 0])
    # ids outside the pool are the bounds check's finding, not a mismatch
    assert invariants.compare_table(table, ref, num_pages=500) == []


def test_free_queue_walk_stops_on_a_cycle():
    nxt = [1, 2, 0, -1]
    walk, err = invariants.walk_free_queue(0, nxt, 4)
    assert walk == [0, 1, 2] and "loops" in err


def test_npu_cumulative_lengths_in_the_plan_are_checked(sharp_llama_dir, monkeypatch):
    # A backend whose plan carries torch_npu's actual_seq_lengths (cu_seqlens_q without the
    # leading 0) and actual_seq_lengths_kv (the context lengths): the packing probe checks
    # both against the sequences' state; here the kv lengths are built from the query lengths.
    real = TorchPagedAttention.plan

    def plan(self, batch, *a):
        p = real(self, batch, *a)
        p.actual_seq_lengths = batch.cu_seqlens_q_np[1:].tolist()
        p.actual_seq_lengths_kv = batch.query_lens_np.tolist()              # the bug
        return p
    monkeypatch.setattr(TorchPagedAttention, "plan", plan)
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64))
    wb = Workbench(eng, log=False).attach("packing")
    rid = eng.add_request(list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    found = [f for f in wb.findings_at_least("error")]
    assert found and {f.evidence["copy"] for f in found} == {"actual_seq_lengths_kv"}
    assert found[0].request_id == rid


def test_a_broken_probe_module_fails_attach_loudly(sharp_llama_dir, monkeypatch, tmp_path):
    import sys

    import probes
    import pytest
    (tmp_path / "broken_probe_mod.py").write_text("import this_module_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(probes.PROBES, "broken", "broken_probe_mod:Broken")
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=16))
    with pytest.raises(probes.ProbeImportError, match="broken.*this_module_does_not_exist"):
        Workbench(eng, log=False).attach()
    sys.modules.pop("broken_probe_mod", None)


def test_fault_parameters_are_typed(sharp_llama_dir):
    import pytest

    from workbench import faults
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=16))
    with pytest.raises(TypeError, match="'hold'.*hold_s"):
        faults.make(eng, "lock_storm", hold=0.1)
    with pytest.raises(TypeError, match="no parameters"):
        faults.make(eng, "stale_binding", steps=3)
    with pytest.raises(ValueError, match="mode='flip'"):
        faults.make(eng, "cu_seqlens_corrupt", mode="flip")
    for name in faults.FAULTS:                       # every fault builds with its defaults
        assert faults.make(eng, name).name == name


# ---- the packing probe's compiled clean paths (probes/packing_native.py) ------------------------------
def test_the_compiled_packing_checks_are_tried_against_numpy_and_blind_ones_refused():
    import pytest
    from conftest import require_compiled
    from probes import packing_native as native
    mod = require_compiled(native.CHECK, "the compiled packing checks")
    native.trial(mod)

    class BlindToSlots:               # skips the slot mapping: a K/V write into another slot reads clean
        decode_plan = staticmethod(mod.decode_plan)

        @staticmethod
        def batch(c, s, pages, toks, ps, copies, *rest):
            return mod.batch(c, s, pages, toks, ps, [(k, a) for k, a in copies if k != native.KINDS["slot_mapping"]],
                             *rest)
    with pytest.raises(AssertionError, match="batch, a slot of another page"):
        native.trial(BlindToSlots)

    class BlindToTables:              # checks the rows, not the pages each walks
        batch = staticmethod(mod.batch)

        @staticmethod
        def decode_plan(tok, rows, lens, tables, *rest):
            return mod.decode_plan(tok, rows, lens, tables * 0, *rest) or True
    with pytest.raises(AssertionError, match="decode plan, a query at another token"):
        native.trial(BlindToTables)


def test_the_compiled_packing_checks_answer_a_healthy_run_and_leave_findings_to_numpy(sharp_llama_dir, monkeypatch):
    # a healthy run with prefix sharing, chunks and preemption: the compiled checks answer every clean batch
    # and decode plan, the numpy ones run only where they say look, and the probe's rows are the same
    from probes import packing_native as native
    from conftest import require_compiled
    require_compiled(native.CHECK, "the compiled packing checks")
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 200, 40).tolist()
    prompts = [prefix + rng.integers(3, 200, n).tolist() for n in (5, 30, 60)] + [rng.integers(3, 200, 70).tolist()]
    real = {"batch": native.batch, "plan": native.plan}
    said, frames, decode_only = {"batch": [], "plan": []}, [], []

    def plan(rec, p):                  # which plans were a decode-only step of the compiled decode kernel
        decode_only.append(not p.prefill and len(p.decode) == 1 and hasattr(p.decode[0], "lens"))
        said["plan"].append(real["plan"](rec, p))
        return said["plan"][-1]
    for compiled in (True, False):
        monkeypatch.setattr(native, "batch", (lambda *a: said["batch"].append(real["batch"](*a)) or said["batch"][-1])
                            if compiled else (lambda *a: False))
        monkeypatch.setattr(native, "plan", plan if compiled else (lambda *a: False))
        eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=14, max_num_batched_tokens=64))
        wb = Workbench(eng, log=False).attach("packing", "page_table")
        eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert wb.findings_at_least("warn") == [] and eng.stats()["num_preemptions"] > 0
        frames.append(wb.probe("packing").frame().drop(columns="check_us"))
    assert said["batch"] and all(said["batch"]) and said["plan"]
    # every decode-only step's plan answered compiled; where the compiled decode kernel runs (not on a CPU
    # that refuses it, `make test-cpus`) there were such steps
    from workbench.engine.attention import native as attention_kernel
    assert all(ok for ok, d in zip(said["plan"], decode_only) if d)
    assert any(decode_only) or attention_kernel.kernel() is None
    assert frames[0].equals(frames[1])
    # a slot mapping bug through the real builder: the compiled check says look, numpy names the token
    from workbench.engine.batch import BatchBuilder
    build = BatchBuilder.build

    def slipped(self, *a, **kw):
        b = build(self, *a, **kw)
        if b.slot_mapping.shape[0] > 3:
            b.slot_mapping[3] += 1
        return b
    prompt, greedy = list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True)
    clean = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64)).generate([prompt], greedy)[0].token_ids
    monkeypatch.setattr(BatchBuilder, "build", slipped)
    said["batch"].clear()
    monkeypatch.setattr(native, "batch", lambda *a: said["batch"].append(real["batch"](*a)) or said["batch"][-1])
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64))
    wb = Workbench(eng, log=False).attach("packing")
    out = eng.generate([prompt], greedy)[0]
    f = next(f for f in wb.findings_at_least("error") if f.kind == "packing-slot-mapping")
    assert out.token_ids != clean                                  # the slipped write changed the text
    assert said["batch"][0] is False and f.request_id == out.request_id and f.evidence["token"] == 3
