"""cu_seqlens probe: each rule on hand-made tensors, the NPU's actual_seq_lengths, and the
cu_seqlens_corrupt fault (attention over the wrong span, named by rule, batch index and request)."""
import numpy as np
import pytest
import torch

from probes.cu_seqlens import check_actual_seq_lengths, check_cu_seqlens
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.events import EVENT_TYPES, BatchPacked

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
I32 = torch.int32
GOOD = [0, 3, 4, 9]                    # three sequences of 3, 1 and 5 tokens
LENS = [3, 1, 5]


# ---- the rules, one at a time ---------------------------------------------------------
def rules(found):
    return {v.rule: v.index for v in found}


def test_a_good_cu_seqlens_passes_every_rule():
    t = torch.tensor(GOOD, dtype=I32)
    assert check_cu_seqlens(t, 9, num_seqs=3, lengths=LENS, max_seqlen=5, device="cpu") == []


@pytest.mark.parametrize("values, kwargs, expected", [
    (torch.tensor(GOOD, dtype=torch.int64), {}, {"dtype": -1}),
    (torch.tensor([0, -1, 3, -1, 4, -1, 9, -1], dtype=I32)[::2], {}, {"contiguous": -1}),
    (torch.tensor(GOOD, dtype=I32), {"device": "cuda"}, {"device": -1}),       # only metadata: no GPU needed
    ([0, 3, 9], {"num_seqs": 3}, {"length": 2}),                              # sequence 2 has no end
    ([1, 3, 4, 9], {}, {"start": 0}),
    ([0, 4, 3, 9], {}, {"decreasing": 1}),
    ([0, 3, 3, 9], {}, {"empty": 1}),
    ([0, 3, 4, 8], {}, {"total": 2}),
    ([0, 2, 4, 9], {"lengths": LENS}, {"segment": 0}),                        # monotone, wrong spans
    (GOOD, {"max_seqlen": 4}, {"max_seqlen": 2}),
], ids=["dtype", "contiguous", "device", "length", "start", "decreasing", "empty", "total", "segment",
        "max_seqlen"])
def test_each_rule_names_its_first_bad_segment(values, kwargs, expected):
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=I32)
    assert rules(check_cu_seqlens(t, 9, **kwargs)) == expected


def test_the_clean_fast_path_agrees_with_the_rules_on_random_tensors():
    """check_cu_seqlens answers a clean tensor in a few operations (every step); on random tensors,
    clean and broken by one entry, its verdict is the rules' own, spelled out here in Python."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        lengths = rng.integers(0 if rng.random() < 0.2 else 1, 9, rng.integers(1, 7)).tolist()
        cu = np.concatenate([[0], np.cumsum(lengths)])
        if rng.random() < 0.6:                       # one entry off, or the told maximum off
            cu[rng.integers(0, len(cu))] += int(rng.choice([-2, -1, 1, 3]))
        mx = max(lengths) + (int(rng.choice([-1, 1])) if rng.random() < 0.2 else 0)
        total = sum(lengths)
        d = np.diff(cu)
        clean = (cu[0] == 0 and (d > 0).all() and cu[-1] == total and list(d) == lengths and d.max() == mx)
        got = check_cu_seqlens(torch.tensor(cu, dtype=torch.int32), total, num_seqs=len(lengths),
                               lengths=lengths, max_seqlen=mx)
        assert (got == []) == clean, (cu.tolist(), lengths, mx, got)


def test_empty_sequences_are_allowed_only_when_asked():
    t = torch.tensor([0, 3, 3, 9], dtype=I32)
    assert check_cu_seqlens(t, 9, lengths=[3, 0, 6], allow_empty=True) == []
    assert rules(check_cu_seqlens(t, 9, lengths=[3, 0, 6])) == {"empty": 1}


def test_actual_seq_lengths_are_cu_seqlens_without_the_leading_zero():
    # torch_npu's TND prefill takes cumulative ends, int64 or a list: no start or dtype rule.
    assert check_actual_seq_lengths([3, 4, 9], 9, num_seqs=3, lengths=LENS) == []
    assert check_actual_seq_lengths(torch.tensor([3, 4, 9]), 9, num_seqs=3) == []
    assert rules(check_actual_seq_lengths([3, 4, 8], 9)) == {"total": 2}
    assert rules(check_actual_seq_lengths([4, 3, 9], 9)) == {"decreasing": 1}
    assert rules(check_actual_seq_lengths([0, 4, 9], 9)) == {"empty": 0}
    assert rules(check_actual_seq_lengths([3, 9], 9, num_seqs=3)) == {"length": 1}
    [v] = check_actual_seq_lengths([3, 4, 8], 9)
    assert "actual_seq_lengths[2]=8" in v.message                   # indexes the caller's list


# ---- the probe on a live engine --------------------------------------------------------
PROMPTS = [np.random.default_rng(0).integers(3, 256, n).tolist() for n in (10, 20, 30)]


def make(path, **kw):
    eng = Engine.from_pretrained(path, EngineConfig(**{"num_pages": 64, **kw}))
    return eng, Workbench(eng, log=False).attach("cu_seqlens")


def tokens(eng):
    return [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def clean(sharp_llama_dir):
    eng, wb = make(sharp_llama_dir)
    out = tokens(eng)
    assert wb.findings_at_least("warn") == []
    return out


def test_healthy_chunked_mixed_batches_are_clean(sharp_llama_dir):
    # Chunked prefill (24-token budget) mixes prefill chunks and decodes in one batch.
    eng, wb = make(sharp_llama_dir, max_num_batched_tokens=24)
    seen = []
    eng.bus.subscribe(BatchPacked, lambda e: seen.append((e.num_prefill, e.num_decode)))
    tokens(eng)
    probe = wb.probe("cu_seqlens")
    assert wb.findings_at_least("warn") == [] and probe.batches_checked == len(seen)
    assert any(p and d for p, d in seen)


def test_swap_attends_over_the_wrong_span_and_is_named(sharp_llama_dir, clean):
    eng, wb = make(sharp_llama_dir)
    with faults.inject(eng, "cu_seqlens_corrupt", mode="swap", index=1) as fault:
        bad = tokens(eng)
    [c] = fault.corrupted
    rids = [0, 1, 2]                                    # a fresh engine numbers requests from 0
    # Rows 1 and 2 traded queries: each attended over the other's pages; row 0 is untouched.
    assert bad[0] == clean[0] and bad[1] != clean[1] and bad[2] != clean[2]
    found = wb.findings_at_least("error")
    assert found and all(f.step == c["step"] for f in found)
    by_rule = {f.evidence["rule"]: f for f in found}
    dec = by_rule["decreasing"]                          # the rule broken, at the swapped entry
    assert dec.evidence["index"] == c["entry"] and dec.request_id == rids[c["entry"]]
    first = min(found, key=lambda f: f.evidence["index"])    # the first bad segment
    assert first.evidence["index"] == c["first_bad"] and first.request_id == c["request_id"]
    assert "batch index" in first.message and first.evidence["values"] == c["after"]


def test_the_npu_lengths_check_sees_the_same_corruption(sharp_llama_dir):
    eng, _ = make(sharp_llama_dir)
    verdicts = []

    def npu_view(e):                                     # what a TND kernel would be handed
        actual = e.cu_seqlens_q[1:].tolist()
        verdicts.append(check_actual_seq_lengths(actual, sum(e.query_lens), num_seqs=len(e.request_ids),
                                                 lengths=e.query_lens))

    eng.bus.subscribe(BatchPacked, npu_view)
    with faults.inject(eng, "cu_seqlens_corrupt"):
        tokens(eng)
    bad = [v for v in verdicts if v]
    assert len(bad) == 1 and "decreasing" in rules(bad[0]) and len(verdicts) > 1


@pytest.mark.parametrize("params, rule, wrong", [
    ({"mode": "truncate"}, "total", "last"),             # the trailing total dropped
    ({"mode": "shift", "index": 1, "delta": 3}, "segment", "first_bad"),   # still monotone
    ({"tensor": "k"}, "decreasing", "entry"),
])
def test_other_corruptions_are_caught(sharp_llama_dir, clean, params, rule, wrong):
    eng, wb = make(sharp_llama_dir)
    with faults.inject(eng, "cu_seqlens_corrupt", **params) as fault:
        tokens(eng)
    [c] = fault.corrupted
    found = {f.evidence["rule"]: f for f in wb.findings_at_least("error")}
    want = {"last": len(c["before"]) - 2, "first_bad": c["first_bad"], "entry": c["entry"]}[wrong]
    assert found[rule].evidence["index"] == want and found[rule].step == c["step"]
    assert found[rule].evidence["tensor"] == ("cu_seqlens_k" if params.get("tensor") == "k" else "cu_seqlens_q")
    if params.get("mode") == "shift":
        assert "decreasing" not in found                 # only the spans give it away
    wb.reset()                                           # undone: the engine runs clean again
    assert tokens(eng) == clean and wb.findings_at_least("warn") == []


def test_every_samples_and_detach_unwires(sharp_llama_dir):
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64))
    wb = Workbench(eng, log=False).attach("cu_seqlens", cu_seqlens={"every": 3})
    steps = []
    count = lambda e: steps.append(e.step)
    eng.bus.subscribe(BatchPacked, count)
    tokens(eng)
    assert wb.probe("cu_seqlens").batches_checked == sum(1 for s in steps if s % 3 == 0) > 0
    eng.bus.unsubscribe(count)
    wb.detach()
    assert eng.pool.observer is None and eng.model.hooks is None
    assert not any(eng.bus.wants(t) for t in EVENT_TYPES)


def test_the_plain_clean_answer_agrees_with_every_rule():
    # plainly_clean is the probe's shortcut: wherever it says clean, check_cu_seqlens finds nothing; and on
    # every planted break (and on many random tensors) it does not say clean
    import itertools

    import numpy as np
    import torch

    from probes.cu_seqlens import check_cu_seqlens, plainly_clean
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9, 3]
    good = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    breaks = {"int64": good.long(), "strided": torch.stack([good, good], 1)[:, 0],
              "a decrease": torch.tensor([0, 5, 4, 15, 18], dtype=torch.int32),
              "a span off": torch.tensor([0, 5, 7, 15, 18], dtype=torch.int32),
              "a missing entry": good[:-1].contiguous(), "a leading 1": good + 1}
    assert plainly_clean(good, lengths, num_seqs=4, max_seqlen=9) and not check_cu_seqlens(
        good, 18, num_seqs=4, lengths=lengths, max_seqlen=9, device="cpu")
    assert not plainly_clean(good, lengths, num_seqs=4, max_seqlen=8)
    for what, t in breaks.items():
        assert check_cu_seqlens(t, 18, num_seqs=4, lengths=lengths, max_seqlen=9, device="cpu"), what
        assert not plainly_clean(t, lengths, num_seqs=4, max_seqlen=9), what
    for _ in range(300):
        n = int(rng.integers(1, 6))
        lens = rng.integers(0, 4, n).tolist()
        cu = list(itertools.accumulate(lens, initial=0))
        if rng.random() < 0.5:
            cu[int(rng.integers(0, n + 1))] += int(rng.integers(-2, 3))
        t, mx = torch.tensor(cu, dtype=torch.int32), int(max(lens)) + int(rng.integers(0, 2))
        if plainly_clean(t, lens, num_seqs=n, max_seqlen=mx):
            assert not check_cu_seqlens(t, sum(lens), num_seqs=n, lengths=lens, max_seqlen=mx, device="cpu"), (cu, lens)
