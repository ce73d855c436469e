"""Issue 27: vLLM checked against the workbench's own ledger, on a hybrid model, with realistic bugs.

A tiny random-weight model written by transformers at test time (no download) whose layer 0 is
sliding-window attention (64 tokens) and layer 1 full attention: vLLM's CPU build gives it two
KV cache groups in one block pool and frees the sliding group's blocks as they leave the window,
mid-request, without telling the workers. The plugin checks each group with its own rule
(ledger.GroupRule), recomputed from the group's spec. vLLM's real EngineCore drives it
(workbench/adapters/vllm/inproc.py); the bugs are planted through the plugin's fault seams in
vLLM's real code paths (faults.py), and each test asserts that vLLM's behaviour really changed
(log-probs, the pool's own ref counts) as well as what the finding names.
"""
from __future__ import annotations

import pytest

from workbench.adapters.vllm.server import vllm_python

from vllm_inproc import fault_file, run_inproc

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")


@pytest.fixture(scope="module")
def hybrid(vllm_models) -> str:
    return vllm_models["hybrid"]


@pytest.fixture(scope="module")
def models(vllm_models) -> dict:
    return vllm_models


def moved(clean, r) -> dict[str, float]:
    """Per request, the largest change of a sampled token's log-prob between two runs."""
    return {rid: max((abs(a - b) for a, b in zip(lp, r.result["logprobs"].get(rid, []))), default=0.0)
            for rid, lp in clean.result["logprobs"].items()}


@pytest.mark.parametrize("kind, path", [("hybrid", "sync"), ("hybrid", "batch-queue"), ("sliding", "sync"),
                                        ("chunked", "sync")])
def test_a_long_clean_workload_is_silent_with_every_group_checked(models, kind, path):
    # prefix hits (a 70-token shared prefix), chunked prefill (a 64-token budget under ~90-150-token
    # prompts), preemption (48 blocks for 16 requests), aborts, blocks leaving the 64-token window;
    # the batch queue (async scheduling's path) frees window blocks only once a step's results are back
    # chunked: Llama 4's chunked-local layer in a ChunkedLocalAttentionSpec group of its own (vLLM keeps it
    # in the full group unless told otherwise), whose blocks before the current 64-token chunk are freed
    blocks = {"hybrid": "48", "sliding": "20", "chunked": "48"}[kind]           # small enough to preempt
    r = run_inproc("--model", models[kind], "--requests", "16", "--max-tokens", "160", "--num-blocks", blocks,
                   "--max-num-batched-tokens", "64", "--stagger", "3", "--abort", "r3:20", "--abort", "r7:60",
                   *(["--batch-queue"] if path == "batch-queue" else []),
                   env={"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"} if kind == "chunked" else None)
    assert r.rc == 0, r.log[-3000:]
    assert not r.at_least("warn"), [f.message for f in r.findings]
    # every per-request structure of the plugin is empty again once every request ended (finished in
    # update_from_output, aborted, preempted and resumed): nothing grows with the requests served
    sizes = r.result["plugin_sizes"]
    assert {k: sizes[k] for k in ("crc", "progress", "progress_t", "ledger_requests", "books_live")} == \
        dict.fromkeys(("crc", "progress", "progress_t", "ledger_requests", "books_live"), 0), sizes
    assert sizes["provenance_records"] <= r.result["num_blocks"]           # bounded by the pool, not by history
    # the attention check (issue 37) ran through all of it, one row a step, and stayed silent
    (attn,) = r.attention_costs.values()
    assert attn["checks"] > 100 and attn["max_err"]["read"] < 0.01, attn
    res = r.result
    if kind == "sliding":                     # one SlidingWindowSpec group: the single-group sweep rules too
        assert res["kv_cache_groups"] == ["SlidingWindowSpec"] and res["preemptions"] > 0
        assert res["num_free_after"] == res["num_blocks"] - 1 and res["min_ref_cnt"] == 0
        return
    first = {"hybrid": "SlidingWindowSpec", "chunked": "ChunkedLocalAttentionSpec"}[kind]
    assert res["kv_cache_groups"] == [first, "FullAttentionSpec"]
    assert res["preemptions"] > 0 and "r3" not in res["finished"] and len(res["finished"]) == 14
    assert res["num_free_after"] == res["num_blocks"] - 1 and res["min_ref_cnt"] == 0     # all back but the null block
    reason = r.statuses["vllm_pool"]["reason"]
    rule = {"hybrid": "window 64 tokens", "chunked": "chunks of 64 tokens"}[kind]
    assert f"group 0 {first} (block 32; {rule}" in reason and "group 1 FullAttentionSpec" in reason, reason
    assert r.statuses["vllm_attention"]["path"].startswith("2 of 2 attention layers"), r.statuses["vllm_attention"]
    (cost,) = r.costs.values()
    assert cost["groups"].get(0, 0) > 100 and cost["groups"].get(1, 0) > 100, cost      # both groups' metadata
    assert max(s.get("hits_checked") or 0 for s in r.steps) > 0                         # prefix hits were checked


WINDOW = ("--requests", "6", "--max-tokens", "150", "--num-blocks", "80")


def test_a_window_edge_freed_one_block_early_is_caught_in_the_sliding_group(hybrid, tmp_path):
    clean = run_inproc("--model", hybrid, *WINDOW)
    assert clean.rc == 0 and not clean.at_least("warn"), [f.message for f in clean.findings]
    r = run_inproc("--model", hybrid, *WINDOW,
                   env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "window_frees_one_block_early")})
    assert r.rc == 0
    d = moved(clean, r)
    assert max(d.values()) > 1e-2, d                       # another request's K/V was read: log-probs moved
    freed = [f for f in r.at_least("error") if f.kind == "refcount" and "freed while in use" in f.message]
    assert freed, [f.message for f in r.findings]
    for f in freed:
        # named: the block, the request reading it, and where: the sliding group, never the full one
        held = f.evidence["held_as"]
        assert f.evidence["ref_cnt"] == 0 and f.page is not None and f.request_id == held[0]["request"]
        assert {h["kv_cache_group"] for h in held} == {0}, held
    assert len({f.request_id for f in freed}) >= 3


def test_a_prefix_hit_that_takes_no_reference_is_caught_at_the_hit(hybrid, tmp_path):
    args = ("--model", hybrid, "--requests", "6", "--max-tokens", "100", "--num-blocks", "72", "--stagger", "4")
    clean = run_inproc(*args)
    assert clean.rc == 0 and not clean.at_least("warn") and clean.result["min_ref_cnt"] == 0
    r = run_inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "prefix_hit_skips_ref")})
    assert r.rc == 0 and r.result["min_ref_cnt"] < 0          # vLLM's pool really went wrong: refs below 0
    first = [f for f in r.at_least("error") if f.kind == "refcount"]
    assert first, [f.message for f in r.findings]
    step = min(f.step for f in first)
    at_hit = [f for f in first if f.step == step]
    # r1 arrives 4 steps after r0 and hits r0's two shared-prefix blocks in each group. Three are named
    # at once (ref 1, two readers); the sliding group's first one r1 may let go as soon as its prefill
    # leaves it behind the window, so there ref 1 is right until r1's (untaken) reference is dropped:
    # then it is 0 while r0 still reads it, freed while in use
    assert len(at_hit) >= 3 and step <= 8, [f.message for f in at_hit]
    for f in at_hit:
        assert f.evidence["ref_cnt"] == 1 and f.evidence["mapped"] == 2
        assert {h["request"] for h in f.evidence["held_as"]} == {"r0", "r1"}
        assert {h["index"] for h in f.evidence["held_as"]} <= {0, 1}
    assert {h["kv_cache_group"] for f in at_hit for h in f.evidence["held_as"]} == {0, 1}
    freed = [f for f in first if f.evidence["ref_cnt"] == 0 and f.step <= step + 4]
    assert freed and freed[0].request_id == "r0" and freed[0].evidence["held_as"][0]["kv_cache_group"] == 0
    # the checks ran on their own thread during the forwards (aside.py); inline on vLLM's thread they
    # check the same states and find the same blocks at the same steps
    assert "checks on their own thread" in r.statuses["vllm_pool"]["path"]
    assert r.result["plugin_sizes"]["check_thread_jobs"] >= r.result["steps"] > 0, r.result["plugin_sizes"]
    inline = run_inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "prefix_hit_skips_ref"),
                                    "PAGEDKV_VLLM_CHECK_THREAD": "0"})
    assert "checks inline on vLLM's thread" in inline.statuses["vllm_pool"]["path"]

    def seen(run):
        return sorted((f.step, f.kind, f.request_id, f.page, f.evidence.get("ref_cnt")) for f in run.at_least("error"))
    assert seen(inline) == seen(r)


def test_a_resumed_request_whose_blocks_are_appended_is_caught_naming_it(hybrid, tmp_path):
    args = ("--model", hybrid, "--requests", "12", "--max-tokens", "160", "--num-blocks", "48",
            "--max-num-batched-tokens", "128")
    clean = run_inproc(*args)
    assert clean.rc == 0 and not clean.at_least("warn") and clean.result["preemptions"] > 0
    r = run_inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "resume_appends_blocks")})
    assert r.rc == 0
    assert max(moved(clean, r).values()) > 1e-2                # the kernel read freed blocks: log-probs moved
    tables = sorted((f for f in r.at_least("error") if f.kind == "block-table"), key=lambda f: f.step)
    assert tables, [f.message for f in r.findings]
    f = tables[0]
    assert f.request_id in r.result["preempted"], (f.message, r.result["preempted"])   # the resumed request
    assert f.evidence["index"] == 0 and f.evidence["got"] != f.evidence["want"]
    assert "kv_cache_group" in f.evidence


def test_a_request_the_add_path_never_queues_is_named_lost(models, tmp_path):
    # The same books as our engine's request_lifecycle probe (probes/request_books.py): r2 is handed
    # to Scheduler.add_request, which records it and never queues it. vLLM keeps it unfinished and
    # schedules nothing for it (the run ends at --max-steps with r2 not finished); it is named lost.
    args = ("--model", models["plain"], "--requests", "4", "--max-tokens", "8", "--max-steps", "120")
    r = run_inproc(*args, env={"PAGEDKV_VLLM_FAULT_FILE": fault_file(tmp_path, "add_loses_request")})
    assert r.rc == 0, r.log[-3000:]
    assert "r2" not in r.result["finished"] and {"r0", "r1", "r3"} <= set(r.result["finished"])
    lost = [f for f in r.at_least("error") if f.kind == "request-lost"]
    assert [f.request_id for f in lost] == ["r2"], [f.message for f in r.findings]
    assert lost[0].evidence["last_place"] == "intake" and lost[0].probe == "request_lifecycle"
