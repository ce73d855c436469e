"""Issue 28, our engine's side: the flight recorder's ring, its crash safety and what opens from it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from workbench import Engine, EngineConfig, SamplingParams
from workbench.event_log import EventLog
from workbench.recorder.reader import RecordingError, open_recording
from workbench.recorder.ring import SegmentRing
from workbench.recorder.reader import load_trace
from workbench.trace.schema import TraceFormatError
from workbench.trace.timetravel import TimeTravel


def prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    pre = rng.integers(3, 256, 40).tolist()
    return [pre + rng.integers(3, 256, int(k)).tolist() for k in rng.integers(3, 40, n)]


def test_a_recording_replays_the_pool_exactly_and_its_requests_as_a_trace(sharp_llama_dir, tmp_path):
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=14, max_num_batched_tokens=64,
                                                               record_dir=str(tmp_path / "rec")))
    live = EventLog(eng.bus, max_rows=None)              # the live engine's own events, for comparison
    ps = prompts()
    eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0              # a pool small enough to preempt and evict
    rec = open_recording(tmp_path / "rec")
    assert rec.header["schema"] == "kvwb-recording/1" and rec.num_blocks == 14 and rec.block_size == 16
    assert rec.header["engine_config"]["max_num_batched_tokens"] == 64 and not rec.skipped
    # the pool at every recorded step, rebuilt from the recording, equals the one rebuilt from the live log
    tt, ref = rec.time_travel(), TimeTravel(live, 14)
    seen = {k: max(tt.state_at(s).counts()[k] for s in range(1, eng.step_count + 1)) for k in ("owned", "shared")}
    assert seen["owned"] > 0 and seen["shared"] > 0          # prefix sharing really happened in the window
    for step in range(1, eng.step_count + 1):
        a, b = tt.state_at(step), ref.state_at(step)
        assert (a.states == b.states).all() and (a.ref == b.ref).all() and a.owner_sets() == b.owner_sets(), step
    tr = load_trace(tmp_path / "rec")
    assert tr.format == "recording" and [r.prompt_token_ids for r in tr] == ps
    assert all(r.output_len == 30 for r in tr) and tr.records[0].sampling.get("ignore_eos") is True


def test_privacy_keeps_lengths_and_page_digests_only(sharp_llama_dir, tmp_path):
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, record_dir=str(tmp_path / "r"),
                                                               record_privacy=True))
    ps = prompts(3)
    eng.generate(ps, SamplingParams(max_tokens=4, ignore_eos=True))
    text = "".join(p.read_text() for p in (tmp_path / "r").glob("seg-*.jsonl"))
    assert "prompt_token_ids" not in text
    tr = load_trace(tmp_path / "r")
    assert [r.prompt_len for r in tr] == [len(p) for p in ps]
    # the shared 40-token prefix: the first two pages' digests agree across requests, so replay shares them
    assert tr.records[0].hash_ids[:2] == tr.records[1].hash_ids[:2] and tr.records[0].hash_block_size == 16


def test_the_ring_keeps_its_cap_dropping_the_oldest_segment(tmp_path):
    ring = SegmentRing(tmp_path, {"writer": "test"}, max_bytes=64 * 1024, segment_bytes=8 * 1024)
    for i in range(20_000):
        ring.write({"k": "ev", "e": "EngineIdle", "step": i, "t_ns": i})
        if i % 50 == 0:
            ring.flush()
    ring.close()
    segs = sorted(tmp_path.glob("seg-*.jsonl"))
    assert ring.dropped_segments > 0 and sum(p.stat().st_size for p in segs) <= 64 * 1024 + 8 * 1024
    rec = open_recording(tmp_path)
    steps = [f["step"] for _, f in rec.events]
    assert steps == list(range(steps[0], 20_000))          # the newest window, whole and in order


def test_write_plain_reads_back_as_write_does_and_falls_back_on_what_it_cannot_encode(tmp_path):
    """The per-step records (ints, strings, lists and dicts of them) through msgspec read back exactly as
    json.dumps's do: non-ASCII request ids, int keys, big ints; a numpy int (msgspec has no plain encoding
    for it) goes through write() (json), so nothing is lost or changed."""
    from workbench.recorder import ring as ring_mod
    assert ring_mod._PLAIN_ENCODER is not None, "msgspec ([test] extra) is what vLLM's environment runs"
    recs = [{"k": "tokens", "step": 7, "out": {"cmpl-é-1": [1, 2, 49151], "r2": 3}, "finished": ["r2"]},
            {"k": "step", "step": 8, "scheduled": {"a": 1, "b": 17}, "preempted": []},
            {"k": "blocks", "step": 8, "request_id": "a", "groups": [[3, 4], [2**40]], "replace": False},
            {"k": "ev", "e": "StepFinished", "step": 9, "t_ns": 2**62, "map": {1: "x"}, "none": None, "ok": True},
            {"k": "odd", "step": 10, "n": np.int64(5), "ids": (1, 2)}]
    for how in ("write", "write_plain"):
        ring = SegmentRing(tmp_path / how, {"writer": "test"})
        for r in recs:
            getattr(ring, how)(r)
        ring.close()
    lines = {how: next((tmp_path / how).glob("seg-*.jsonl")).read_text("utf-8").splitlines()[1:]
             for how in ("write", "write_plain")}
    plain, dumped = ([json.loads(ln) for ln in lines[how]] for how in ("write_plain", "write"))
    assert len(plain) == len(recs) and plain == dumped
    assert "cmpl-é-1" in lines["write_plain"][0] and "\\u00e9" in lines["write"][0]   # UTF-8 vs escaped: one value


def test_a_corrupt_line_and_a_torn_tail_are_named_and_the_rest_opens(sharp_llama_dir, tmp_path):
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, record_dir=str(tmp_path / "r"),
                                                               record_max_bytes=16 * 1024))
    eng.generate(prompts(8), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.recorder.close()
    segs = sorted((tmp_path / "r").glob("seg-*.jsonl"))
    assert len(segs) >= 2
    lines = segs[0].read_text().splitlines(keepends=True)
    lines[3] = '{"k": "ev", "e": "PagesFreed", "pages": [1, 2\n'          # a line damaged on disk
    segs[0].write_text("".join(lines))
    with open(segs[-1], "a") as f:
        f.write('{"k": "ev", "e": "StepFin')                               # the tail a SIGKILL cut
    with pytest.raises(RecordingError, match=rf"{segs[0].name}:4: not a recording line"):
        open_recording(tmp_path / "r", strict=True)
    rec = open_recording(tmp_path / "r")
    assert rec.skipped == {"corrupt_lines": 1, "torn_last_line": 1} and f"{segs[0]}:4" in rec.problems[0]
    assert len(rec.segments) == len(segs) and rec.events
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TraceFormatError, match="not a recording"):
        load_trace(tmp_path / "nothing")
    # the trace readers sit a layer below the recorder: a directory is named, with where to read it
    from workbench.trace import read_trace
    with pytest.raises(TraceFormatError, match="load_trace"):
        read_trace(tmp_path / "nothing")


KILLED = textwrap.dedent("""
    import sys, numpy as np
    from workbench import Engine, EngineConfig, SamplingParams
    eng = Engine.from_pretrained(sys.argv[1], EngineConfig(num_pages=64, record_dir=sys.argv[2]))
    rng = np.random.default_rng(0)
    for i in range(10_000):
        eng.add_request(rng.integers(3, 256, 20).tolist(), SamplingParams(max_tokens=400, ignore_eos=True))
        eng.step()
        if i == 30:
            print("RUNNING", flush=True)
""")


def test_sigkill_mid_run_loses_at_most_the_step_in_flight(sharp_llama_dir, tmp_path):
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(sharp_llama_dir), str(tmp_path / "r")],
                         stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert p.stdout.readline().strip() == "RUNNING"
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    rec = open_recording(tmp_path / "r")
    steps = [f["step"] for n, f in rec.events if n == "StepFinished"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 30
    # every step whose StepFinished is on disk has its pool events too: TimeTravel rebuilds it
    tt = rec.time_travel()
    assert tt.state_at(steps[-1]).counts()["owned"] > 0
    assert len(rec.requests) >= len(steps) - 1              # requests are written as they arrive


def _shared_prefix_scenario(eng):
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 256, 48).tolist()
    a = eng.add_request(prefix + rng.integers(3, 256, 8).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    b = eng.add_request(prefix + rng.integers(3, 256, 24).tolist(), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    for _ in range(6):
        eng.step()
    eng.add_request(rng.integers(3, 256, 64).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return b


def test_a_finding_freezes_a_bundle_that_replays_into_the_same_finding(sharp_llama_dir, tmp_path):
    from workbench import Workbench, faults
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=8, record_dir=str(tmp_path / "r")))
    wb = Workbench(eng, log=False).attach("page_table")
    with faults.inject(eng, "free_while_shared"):
        b = _shared_prefix_scenario(eng)
    first = wb.findings_at_least("error")[0]
    assert first.kind == "free-while-mapped" and first.request_id == b
    assert eng.recorder.bundles, "a finding >= error freezes a bundle"
    bundle = Workbench.open(eng.recorder.bundles[0])
    assert bundle.path.parent.name == "bundles" and any(f["kind"] == "free-while-mapped" for f in bundle.findings)
    # the bundle's requests, replayed step for step on a fresh engine with the recorded settings and
    # the same bug, give the same finding on the same request; without the bug, none
    for bug in (True, False):
        eng2 = Engine.from_pretrained(sharp_llama_dir, bundle.engine_config())
        wb2 = Workbench(eng2, log=False).attach("page_table")
        if bug:
            with faults.inject(eng2, "free_while_shared"):
                bundle.replay_steps(eng2)
            again = wb2.findings_at_least("error")[0]
            assert again.kind == first.kind and again.request_id == b and again.step == first.step
        else:
            log = bundle.replay_steps(eng2)
            assert not wb2.findings_at_least("warn")
            assert bundle.compare(log) is None or bundle.compare(log)["step"] >= first.step
    # replayed with other settings, the first parting step is named and blamed on the config
    eng3 = Engine.from_pretrained(sharp_llama_dir, bundle.engine_config(max_num_batched_tokens=16))
    part = bundle.compare(bundle.replay_steps(eng3), engine=eng3)
    assert part["step"] == 1 and part["config_differs"] == {"max_num_batched_tokens": (2048, 16)}
    assert "a config difference" in part["said"]
    side = bundle.side_by_side(bundle.replay_steps(
        Engine.from_pretrained(sharp_llama_dir, bundle.engine_config(max_num_batched_tokens=16))))
    assert bool(side.parts.iloc[0]) and side.num_tokens_recorded.iloc[0] > side.num_tokens_replayed.iloc[0] == 16


def test_an_exception_in_a_step_freezes_a_bundle_and_still_raises(sharp_llama_dir, tmp_path):
    from workbench import faults
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, record_dir=str(tmp_path / "r")))
    rng = np.random.default_rng(1)
    eng.add_request(rng.integers(3, 256, 130).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
    with faults.inject(eng, "admission_refuses_long_prompts"):
        with pytest.raises(RuntimeError, match="scheduler stalled"):
            for _ in range(5):
                eng.step()
    (bundle,) = eng.recorder.bundles
    assert bundle.endswith("-exception")
    rec = open_recording(bundle)
    (failed,) = [f for n, f in rec.events if n == "StepFailed"]
    assert "scheduler stalled" in failed["error"] and len(rec.requests) == 1


def test_a_bundle_appears_only_once_whole(tmp_path, monkeypatch):
    # whoever polls bundles/ (an operator, a tool waiting for the SIGUSR1 dump) must never find a
    # bundle whose segments are still being copied
    from workbench.recorder import bundle
    for i in (1, 2):
        (tmp_path / f"seg-{i:06d}.jsonl").write_text('{"k": "header"}\n' * 50)
    seen_while_copying = []
    real = bundle.shutil.copy2

    def copy2(src, dst):
        seen_while_copying.append(sorted(p.name for p in (tmp_path / "bundles").iterdir()))
        return real(src, dst)

    monkeypatch.setattr(bundle.shutil, "copy2", copy2)
    out = bundle.freeze_dir(tmp_path, "SIGUSR1")
    assert len(seen_while_copying) == 2
    assert all(len(names) == 1 and names[0].startswith(".partial-") and not names[0].endswith("-SIGUSR1")
               for names in seen_while_copying), seen_while_copying
    assert [p.name for p in (tmp_path / "bundles").iterdir()] == [out.name] and out.name.endswith("-SIGUSR1")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "seg-000001.jsonl", "seg-000002.jsonl"]
