"""The plugin on vLLM's batch-queue step path, and vLLM unharmed by anything of ours (issue 26).

The batch-queue path (EngineCore.step_with_batch_queue with vLLM's AsyncScheduler, a queue of 2)
is what async scheduling runs on CUDA, vLLM's default there, and what pipeline parallelism
runs. This CPU build cannot reach it from its server: its platform forces async scheduling off,
and `--pipeline-parallel-size 2` dies in vLLM on the first request (with or without the plugin).
So these tests drive vLLM's real EngineCore in one process (workbench/adapters/vllm/inproc.py):
vLLM's EngineArgs, scheduler, KV cache manager, block pool, UniProcExecutor (which hands back
futures as on CUDA), CPU worker and model runner, with the single change of setting
`async_scheduling` back on after the platform's check, so that vLLM itself picks the
AsyncScheduler and step_with_batch_queue. The plugin loads as in a server: vLLM's
load_general_plugins inside EngineCore.__init__. The synchronous path is tested through a real
server in test_vllm_adapter.py, and once more here for the abort leak. The model is the tiny
random-weight Llama (conftest's vllm_models): the checks here are of vLLM's bookkeeping, which is
the same for any Llama, and a planted fault still moves its outputs; SmolLM2 runs in vLLM through
the server in test_vllm_adapter.py.
"""
from __future__ import annotations

import pytest

from workbench.adapters.vllm.server import vllm_python

from vllm_inproc import fault_file, plugin_lines, run_inproc

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")

BQ = ("--batch-queue", "--requests", "8", "--max-tokens", "40")
CLEAN: dict = {}
MODEL: list = []


@pytest.fixture(scope="module", autouse=True)
def _model(vllm_models):
    MODEL[:] = ["--model", vllm_models["plain"]]


def inproc(*args, **kw):
    return run_inproc(*MODEL, *args, **kw)


def clean_run():
    if "bq" not in CLEAN:
        CLEAN["bq"] = inproc(*BQ)
    return CLEAN["bq"]


def test_batch_queue_clean_run_is_silent_and_says_which_path():
    r = clean_run()
    assert r.rc == 0, r.log[-3000:]
    assert r.result["step_fn"] == "step_with_batch_queue" and r.result["scheduler"] == "AsyncScheduler"
    assert r.result["batch_queue_size"] == 2 and len(r.result["finished"]) == 8
    assert not r.at_least("warn"), [f.message for f in r.findings]
    assert not r.errors, r.errors
    pool = r.statuses["vllm_pool"]
    assert pool["active"] and pool["via"] == "Scheduler.schedule + Scheduler.update_from_output"
    assert "step_with_batch_queue, batch queue size 2, AsyncScheduler" in pool["path"]
    meta = r.statuses["vllm_metadata"]
    assert meta["active"] and meta["via"] == "AttentionMetadataBuilder.build" and "CPUModelRunner" in meta["path"]
    # the same two lines in vLLM's log, one per check
    lines = plugin_lines(r.log)
    assert any("vllm_pool: active via Scheduler.schedule + Scheduler.update_from_output "
               "(EngineCore.step_with_batch_queue, batch queue size 2" in ln for ln in lines), lines
    assert any("vllm_metadata: active via AttentionMetadataBuilder.build (CPUModelRunner" in ln for ln in lines)
    # both checks ran, step by step: the pool check on every update_from_output, the metadata one in the worker
    assert len(r.steps) >= r.result["steps"] * 0.5 and r.steps[-1]["full"]
    assert sum(c["checks"] for c in r.costs.values()) > 0


@pytest.mark.parametrize("fault, kind", [("permuted_block_table_rows", "block-table"),
                                         ("slot_mapping_off_at_boundary", "slot-mapping")])
def test_batch_queue_metadata_fault_is_caught_naming_the_request(tmp_path, fault, kind):
    clean = clean_run()
    r = inproc(*BQ, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, fault)})
    assert r.rc == 0 and r.result["step_fn"] == "step_with_batch_queue"
    moved = {rid: max(abs(a - b) for a, b in zip(lp, r.result["logprobs"][rid]))
             for rid, lp in clean.result["logprobs"].items()}
    assert max(moved.values()) > 1e-2, f"the planted fault did not change any output: {moved}"
    found = [f for f in r.at_least("error") if f.kind == kind]
    assert found, [f.message for f in r.findings]
    f = found[0]
    assert f.request_id in r.result["outputs"]
    if kind == "block-table":           # rows 0 and 1 swapped: the first row's request, the block it read
        assert f.evidence["got"] != f.evidence["want"] and f.page == f.evidence["got"]
        assert len(f.evidence["requests"]) == 2
    else:                               # the slot one block on, at a position on a block boundary
        assert f.evidence["got"] - f.evidence["want"] == 32 and "position" in f.message


@pytest.mark.parametrize("path", ["batch-queue", "step"])
def test_abort_leak_is_caught_on_either_step_path(tmp_path, path):
    args = (BQ if path == "batch-queue" else BQ[1:]) + ("--abort", "r3:6")
    r = inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "abort_keeps_blocks")})
    assert r.rc == 0 and "r3" not in r.result["finished"]
    assert r.result["step_fn"] == ("step_with_batch_queue" if path == "batch-queue" else "step")
    leaks = [f for f in r.at_least("error") if f.kind == "leak"]
    assert leaks and leaks[0].request_id == "r3", [f.message for f in r.findings]
    assert leaks[0].page is not None and "last held by request r3" in leaks[0].message
    # the blocks really stayed out of the pool: fewer free at idle than a clean run leaves
    assert r.steps[-1]["num_free"] < clean_run().steps[-1]["num_free"]


# ---- never harm vLLM --------------------------------------------------------------------------
def _serves(r, n=8):
    assert r.rc == 0, r.log[-3000:]
    assert len(r.result["finished"]) == n, r.result["finished"]


def test_unusable_address_keeps_the_checks_and_logs_the_findings(tmp_path):
    r = inproc(*BQ, listen=False, env={"PAGEDKV_VLLM_SANITIZER": "not-an-address",
                                           "PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "permuted_block_table_rows")})
    _serves(r)
    lines = plugin_lines(r.log)
    assert any("PAGEDKV_VLLM_SANITIZER='not-an-address' is not an address" in ln
               and "findings go to vLLM's log only" in ln for ln in lines), lines
    # the checks still ran: the planted fault is in vLLM's log, naming the request
    assert any("vllm_metadata error [block-table]" in ln and "request r" in ln for ln in lines), lines


def test_an_exception_inside_a_check_is_one_log_line_and_vllm_serves():
    pre = ("import workbench.adapters.vllm.sanitizer as s\n"
           "def broken(*a, **k):\n    raise RuntimeError('planted in the pool check')\n"
           "s.touched_block_findings = broken\n")
    r = inproc(*BQ, pre=pre)
    _serves(r)
    assert r.result["outputs"] == clean_run().result["outputs"]
    lines = [ln for ln in plugin_lines(r.log) if "planted in the pool check" in ln]
    assert len(lines) == 1 and "pool check failed (RuntimeError" in lines[0] and "vLLM goes on" in lines[0], lines
    assert any("planted in the pool check" in e for e in r.errors)       # and the workbench hears of it


def test_a_check_that_stops_running_becomes_a_check_inactive_warning():
    # metadata that never reaches the check, as on a runner path the plugin does not see: the
    # builder hook hands every batch straight through
    pre = ("import workbench.adapters.vllm.worker_side as w\n"
           "w.MetadataWatch.on_build = lambda self, builder, cm: cm\n")
    r = inproc(*BQ, pre=pre, env={"PAGEDKV_VLLM_INACTIVE_AFTER": "8"})
    _serves(r)
    warn = [f for f in r.findings if f.kind == "check-inactive"]
    assert warn and warn[0].severity == "warn" and warn[0].probe == "vllm_metadata", [f.message for f in r.findings]
    assert "has not run for 8 steps" in warn[0].message and "CPUModelRunner" in warn[0].message
    assert any("check-inactive" in ln for ln in plugin_lines(r.log))


# ---- prefix provenance (issue 27's first part) ------------------------------------------------
def test_a_prefix_hash_that_forgets_a_token_is_caught_by_provenance(tmp_path):
    # r1.. share r0's prompt except the last token of its first block (position 31); they arrive
    # after r0 has filled its blocks. With the hash leaving that token out, they hit r0's block.
    args = ("--requests", "4", "--max-tokens", "24", "--stagger", "4", "--differ-at", "31")
    clean = inproc(*args)
    assert clean.rc == 0 and not clean.at_least("warn"), [f.message for f in clean.findings]
    r = inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "prefix_hash_ignores_last_token")})
    assert r.rc == 0
    # the K/V really was another request's: r1's log-probs moved, r0's (the filler) did not
    moved = {rid: max(abs(a - b) for a, b in zip(clean.result["logprobs"][rid], r.result["logprobs"][rid]))
             for rid in clean.result["logprobs"]}
    assert moved["r0"] == 0 and all(moved[f"r{i}"] > 1e-3 for i in (1, 2, 3)), moved
    found = {f.request_id: f for f in r.at_least("error") if f.kind == "prefix-provenance"}
    assert set(found) == {"r1", "r2", "r3"}, [f.message for f in r.findings]
    f = found["r1"]
    assert f.evidence["position"] == 31 and f.evidence["filled_for"] == "r0" and f.evidence["index"] == 0
    assert f.page is not None and "first differing token at position 31" in f.message


def test_a_prefix_cache_reset_drops_the_records_and_the_check_still_sees_refilled_blocks(tmp_path):
    # vLLM's reset_prefix_cache (an RLHF weight update, a harness) at step 2 preempting the running r0,
    # and again after the run. A reset leaves no hash, so no block can be hit before it is refilled:
    # the plugin drops its provenance records at once (before, they stayed until refilled). r0 refills
    # its blocks after the reset; with the hash fault, r1..r3 still hit them and are still named.
    args = ("--requests", "4", "--max-tokens", "24", "--stagger", "4", "--differ-at", "31",
            "--reset-prefix", "2:running", "--reset-prefix", "0")
    clean = inproc(*args)
    assert clean.rc == 0 and not clean.at_least("warn"), [f.message for f in clean.findings]
    assert [ok for _, ok in clean.result["prefix_resets"]] == [True, True]
    assert clean.result["preemptions"] >= 1 and len(clean.result["finished"]) == 4     # r0 was preempted for it
    sizes = clean.result["plugin_sizes"]
    assert sizes["prefix_resets"] == 2 and sizes["provenance_records"] == 0, sizes
    r = inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "prefix_hash_ignores_last_token")})
    assert r.rc == 0
    found = {f.request_id: f for f in r.at_least("error") if f.kind == "prefix-provenance"}
    assert set(found) == {"r1", "r2", "r3"}, [f.message for f in r.findings]
    assert found["r1"].evidence["filled_for"] == "r0" and found["r1"].evidence["position"] == 31


# ---- forward progress (issue 27, item 3) -------------------------------------------------------
def test_a_request_refused_admission_with_room_in_the_pool_is_stalled_naming_it(tmp_path):
    # r3's prompt (126 tokens) is refused by allocate_slots though the pool has ~1,500 free blocks:
    # once r0..r2 finish, nothing runs and r3 waits forever (the Running=0 / Waiting=N hang)
    r = inproc("--requests", "4", "--max-tokens", "16", "--max-steps", "120",
                   env={"PAGEDKV_VLLM_STALL_AFTER": "32", "PAGEDKV_VLLM_STALL_AFTER_S": "0",
                        "PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "admission_refuses_long_prompts")})
    assert r.rc == 0 and r.result["steps"] == 120 and sorted(r.result["finished"]) == ["r0", "r1", "r2"]
    assert r.result["outputs"]["r3"] == []                          # it really never ran
    (f,) = [f for f in r.findings if f.kind == "stalled"]
    assert f.severity == "error" and f.request_id == "r3" and "nothing is running: the engine is hung" in f.message
    assert f.evidence["needs"] <= f.evidence["free_blocks"] and f.evidence["waited"] >= 32
