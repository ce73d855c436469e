"""Issue 28 in vLLM: the plugin's flight recorder on vLLM's real EngineCore (inproc.py).

On whenever the plugin is (PAGEDKV_RECORD_DIR moves it), it records the requests and the pool in
the workbench's event schema; a finding >= error freezes a repro bundle; the bundle opens with
Workbench.open, its pool scrubs with TimeTravel, its requests replay through our simulator with
the recorded settings and back through vLLM, where the same bug gives the same finding again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import Workbench
from workbench.adapters.vllm.server import ROOT, vllm_python
from workbench.cli import main as kvwb

from vllm_inproc import fault_file, run_inproc

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")

ARGS = ("--requests", "6", "--max-tokens", "40", "--num-blocks", "80", "--stagger", "4")


@pytest.fixture(scope="module")
def hybrid(vllm_models) -> str:
    return vllm_models["hybrid"]


def only_dir(root: Path) -> Path:
    (d,) = [p for p in root.iterdir() if p.is_dir()]
    return d


def test_the_recorder_keeps_vllms_requests_and_pool_and_they_replay(hybrid, tmp_path):
    r = run_inproc("--model", hybrid, *ARGS, env={"PAGEDKV_RECORD_DIR": str(tmp_path / "rec")})
    assert r.rc == 0 and not r.at_least("warn")
    d = only_dir(tmp_path / "rec")
    assert f"flight recorder: {d}" in r.log                      # the path is logged
    rec = Workbench.open(d)
    h = rec.header
    assert h["writer"] == "vllm plugin" and h["vllm"] == "0.32.0" and h["block_size"] == 32
    assert h["num_blocks"] == r.result["num_blocks"] and h["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert sorted(q["id"] for q in rec.requests) == sorted(r.result["outputs"])
    assert all(len(q["prompt_token_ids"]) > 70 and q["output_len"] == 40 for q in rec.requests)
    # what vLLM produced, per request, from update_from_output's outputs: the tokens the driver got back
    outs = rec.outputs()
    assert {k: o["tokens"] for k, o in outs.items()} == r.result["outputs"] and all(o["finished"] for o in outs.values())
    steps = [f for n, f in rec.events if n == "StepFinished"]
    assert len(steps) == r.result["steps"] and max(s["num_running"] for s in steps) >= 2
    # each request's blocks per KV cache group over its life: the full-attention group holds one block per
    # 32 tokens computed (prompt + 39: the last token sampled is never fed back)
    for q in rec.requests:
        window, full = rec.blocks_of(q["id"])
        n = len(q["prompt_token_ids"]) + 39
        assert len(full) == -(-n // 32) and len(window) == len(full), (q["id"], len(window), len(full), n)
        assert len(set(full)) == len(full) and 0 not in full     # the null block only pads a window's hit
    # the recorded pool, scrubbed: blocks owned and shared (the 70-token prefix) mid-run, all back at the end
    tt = rec.time_travel()
    mid = tt.state_at(steps[len(steps) // 2]["step"]).counts()
    assert mid["owned"] > 0 and mid["shared"] > 0 and tt.state_at(steps[-1]["step"]).counts()["owned"] == 0
    # its requests replay through our simulator with the recorded block size and pool
    assert kvwb(["replay", str(d), "--no-progress"]) == 0
    res = rec.replay()
    assert len(res.requests) == 6 and res.engine.config.page_size == 32 and res.engine.config.num_pages == 80


def test_a_finding_freezes_a_bundle_and_replayed_into_vllm_the_bug_is_found_again(hybrid, tmp_path):
    faults = fault_file(tmp_path, "window_frees_one_block_early")
    r = run_inproc("--model", hybrid, *ARGS, env={"PAGEDKV_RECORD_DIR": str(tmp_path / "rec"),
                                                  "PAGEDKV_VLLM_FAULT_FILE": faults})
    first = min(r.at_least("error"), key=lambda f: f.step)
    d = only_dir(tmp_path / "rec")
    bundles = sorted((d / "bundles").iterdir())             # one per kind of error, the first one's window each
    (bundle,) = [b for b in bundles if b.name.endswith("finding-refcount")]
    assert f"repro bundle frozen (finding-refcount): {bundle}" in r.log
    b = Workbench.open(bundle)
    assert any(f["kind"] == "refcount" and f["request_id"] == first.request_id for f in b.findings)
    # the pool the step before the finding, from the bundle alone
    before = b.time_travel().state_at(first.step - 1)
    assert before.counts()["owned"] > 0
    # the bundle's requests, fed to vLLM again at their recorded steps: the bug recurs on the same request
    again = run_inproc("--model", hybrid, "--trace", str(bundle), "--num-blocks", "80",
                       env={"PAGEDKV_RECORD": "0", "PAGEDKV_VLLM_FAULT_FILE": faults})
    assert again.rc == 0
    assert first.request_id in {f.request_id for f in again.at_least("error") if f.kind == "refcount"}
    clean = run_inproc("--model", hybrid, "--trace", str(bundle), "--num-blocks", "80", env={"PAGEDKV_RECORD": "0"})
    assert clean.rc == 0 and not clean.at_least("warn")


def test_sigkill_leaves_a_recording_that_opens(hybrid, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_VLLM_", "PAGEDKV_RECORD"))}
    env.update(PAGEDKV_VLLM_SANITIZER="tcp://127.0.0.1:9", PAGEDKV_RECORD_DIR=str(tmp_path / "rec"))
    code = "import sys\nfrom workbench.adapters.vllm.inproc import main\nmain(sys.argv[1:])\n"
    p = subprocess.Popen([str(vllm_python()), "-c", code, "--model", hybrid, "--requests", "64", "--max-tokens",
                          "400", "--stagger", "2", "--num-blocks", "400"], cwd=str(ROOT), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:           # until the recording has a few dozen steps on disk
            segs = list((tmp_path / "rec").glob("*/seg-*.jsonl"))
            if segs and sum(s.read_text().count('"e":"StepFinished"') for s in segs) > 40:
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    rec = Workbench.open(only_dir(tmp_path / "rec"))
    steps = [f["step"] for n, f in rec.events if n == "StepFinished"]
    assert len(steps) > 40 and steps == sorted(steps) and rec.requests
    assert set(rec.skipped) <= {"torn_last_line"}            # at most the tail in flight is lost
    assert rec.time_travel().state_at(steps[-1]).counts()["owned"] > 0
