"""Tensor parallel over torch.distributed: real gloo processes on 127.0.0.1, the real default model.

TP=2 is two processes: the test's own (rank 0, the driver) and one spawned worker (or two
processes started by torchrun). SmolLM2-135M has 9 query heads and 3 KV heads: rank 0 holds
KV heads 0-1 (query heads 0-5), rank 1 KV head 2 (query heads 6-8).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from workbench import ConfigError, Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine.model_config import ModelConfig
from workbench.engine.parallel import RankFailed, plan_shards
from workbench.events import PagesAllocated, PagesShared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEM = ("You are a careful assistant for an on-call engineer. Answer in plain words, briefly and exactly, "
          "and say so when you do not know. Never invent numbers.")
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
             "Write a haiku about paged memory.", "List three prime numbers.",
             "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Hi"]
CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
GREEDY32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, deadline_s=15.0) -> list[int]:
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def smol_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
                eos_token_ids=(2,))
    return ModelConfig(**{**base, **kw})


# ---- the split ------------------------------------------------------------------------------
def test_smollm2_heads_split_in_whole_gqa_groups():
    mc = smol_config()
    p2 = plan_shards(mc, 2)
    assert p2.sizes("kv_heads") == [2, 1] and p2.sizes("q_heads") == [6, 3]
    assert p2.q_heads == ((0, 6), (6, 9)) and p2.kv_heads == ((0, 2), (2, 3))
    assert sum(p2.sizes("mlp_rows")) == 1536 and all(n % 16 == 0 for n in p2.sizes("mlp_rows"))
    assert p2.sizes("vocab_rows") == [24576, 24576]
    # the MLP split evens the weight bytes per rank out (rank 0 holds twice rank 1's attention)
    per_rank = [(q + 2 * k) * 64 * 576 + 576 * q * 64 + 3 * 576 * i
                for q, k, i in zip(p2.sizes("q_heads"), p2.sizes("kv_heads"), p2.sizes("mlp_rows"))]
    assert max(per_rank) / min(per_rank) < 1.02
    p3 = plan_shards(mc, 3)
    assert p3.sizes("q_heads") == [3, 3, 3] and p3.sizes("kv_heads") == [1, 1, 1]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 .*3 KV heads \(9 query heads"):
        plan_shards(mc, 4)


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_tensor_parallel_size_validated(bad):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=bad)


def test_too_many_ranks_for_the_model_fails_before_any_process(tiny_llama_dir):
    import multiprocessing
    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 cannot split this model's 2 KV heads"):
        Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, tensor_parallel_size=3))
    assert set(p.pid for p in multiprocessing.active_children()) == before


# ---- SmolLM2 at TP=2 against TP=1 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2():
    # A small pool (preemption), a small token budget (chunked prefill), a shared system prompt
    # (prefix-cache hits); the probes watch from the first step.
    eng = Engine.from_default(EngineConfig(num_pages=24, max_num_batched_tokens=128, tensor_parallel_size=2))
    wb = Workbench(eng).attach("rank_consistency", "page_table")
    yield eng, wb
    pids = eng.parallel.worker_pids()
    wb.detach()
    eng.close()
    assert wait_gone(pids) == []


@pytest.fixture(scope="module")
def reference(smollm2_engine):
    return [o.token_ids for o in smollm2_engine.generate(CHATS, GREEDY32)]


@pytest.fixture(scope="module")
def tp2_outputs(tp2):
    eng, wb = tp2
    return eng.generate(CHATS, GREEDY32)


def test_tp2_greedy_equals_tp1_with_prefix_hits_chunks_and_preemption(tp2, tp2_outputs, reference):
    eng, wb = tp2
    st = eng.stats()
    assert st["num_preemptions"] > 0, st
    assert st["prefix_cache_hits"] >= 2 * 16, st
    packed = wb.log.frame("BatchPacked")
    assert (packed.num_prefill > 0).sum() >= 2 and packed.num_tokens.max() <= 128   # prompts in chunks
    assert all(len(o.token_ids) == 32 for o in tp2_outputs)
    assert [o.token_ids for o in tp2_outputs] == reference
    assert "Paris" in tp2_outputs[0].text


def test_clean_tp2_run_is_silent_and_every_rank_reports(tp2, tp2_outputs):
    eng, wb = tp2
    assert wb.findings_at_least("info") == [], wb.findings[["kind", "message"]].to_string()
    probe = wb.probe("rank_consistency")
    assert probe.checks == len(wb.log.frame("StepFinished")) and probe.checks > 32
    ranks = wb.log.frame("RankStepFinished")
    assert set(ranks["rank"]) == {0, 1}
    per_step = ranks.groupby("step")
    assert (per_step.table_crc.nunique() == 1).all() and (per_step["rank"].count() == 2).all()
    assert (ranks.duration_ns > 0).all() and (ranks.comm_ns > 0).all() and (ranks.bytes > 0).all()
    assert (ranks.comm_ns < ranks.duration_ns).all()


def test_tp2_teacher_forced_logits_match_tp1(tp2, tp2_outputs, smollm2_engine):
    eng, _ = tp2
    prompts = [p.token_ids for p in tp2_outputs[:3]]          # prompt + answer: long, several pages
    prompts = [eng._prompt_ids(CHATS[i]) + prompts[i] for i in range(3)]
    assert all(len(p) <= 128 for p in prompts)               # one at a time: the engine's 128-token budget
    ours = [eng.score([p])[0] for p in prompts]
    ref = smollm2_engine.score(prompts)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        # fp32 with another summation order (shards, all-reduce, GEMM kernels chosen per shape):
        # ~1e-5 of the logits' scale; a wrong shard or reduction is off by 1e-1 and more.
        diff = (a - b).abs().max().item()
        assert diff < 1e-5 * b.abs().max().item() + 1e-4, diff


def test_rank_desync_caught_at_the_first_drifted_step_and_fixed(tp2, tp2_outputs):
    eng, wb = tp2
    prompts, params = CHATS[:4], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng.reset_prefix_cache()
    clean = eng.generate(prompts, params)
    wb.reset()
    first_step = eng.step_count + 1
    with faults.inject(eng, "rank_desync", rank=1) as fault:
        garbled = eng.generate(prompts, params)
    lost = fault.dropped                                    # read from rank 1 itself
    assert lost, "rank 1 lost no update"
    drift_step = min(s for s, *_ in lost)
    assert drift_step == first_step                         # admissions in rows 1 and 3 are lost at once
    changed = [i for i, (a, b) in enumerate(zip(clean, garbled)) if a.token_ids != b.token_ids]
    assert changed, "the fault changed no answer"
    found = [f for f in wb.all_findings() if f.kind == "rank-desync"]
    assert found and min(f.step for f in found) == drift_step
    first = [f for f in found if f.step == drift_step]
    lost_rids = {rid for s, rid, row, n in lost if s == drift_step}
    assert {f.request_id for f in first} == lost_rids
    held = {}
    log = wb.log
    for et in (PagesAllocated, PagesShared):
        df = log.frame(et)
        for r in df[df.step <= drift_step].itertuples():
            held.setdefault(r.request_id, set()).update(r.pages)
    for f in first:
        ev = f.evidence
        assert ev["rank"] == 1 and "rank 1" in f.message and f"request {f.request_id}" in f.message
        assert ev["binds_host_copy"] is True and ev["page_list_rank"] is None       # its admission never arrived
        assert ev["pages_driver"] and set(ev["pages_driver"]) <= held[f.request_id]
        assert all(a != b for a, b in zip(ev["pages_rank"], ev["pages_driver"]))
        assert f.page in ev["pages_driver"]
    assert any(f.kind == "rank-pool-digest" for f in wb.all_findings())
    # the fix: one source of truth, the host copies resynced; same prompts, clean again
    wb.reset()
    fixed = eng.generate(prompts, params)
    assert [o.token_ids for o in fixed] == [o.token_ids for o in clean]
    assert wb.findings_at_least("info") == []


# ---- lifecycle: a dead rank, an interrupt, a dead driver, torchrun ----------------------------------
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)


def tiny_prompts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(20, 60))).tolist() for _ in range(n)]


def test_killed_worker_names_the_rank_and_leaves_no_process(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=512, tensor_parallel_size=2))
    pids = eng.parallel.worker_pids()
    assert len(pids) == 1 and alive(pids[0])
    eng.generate(tiny_prompts(2), SamplingParams(max_tokens=4))          # it runs
    threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank 1 \(pid {pids[0]}\) killed by signal SIGKILL during step \d+"):
        eng.generate(tiny_prompts(), LONG)
    assert time.monotonic() - t0 < 20
    assert wait_gone(pids) == []
    with pytest.raises(RankFailed, match="unusable: rank 1"):
        eng.generate(tiny_prompts(1), SamplingParams(max_tokens=2))
    eng.close()


@pytest.mark.parametrize("path", ["gloo", "shm"])
def test_all_reduce_through_gloo_or_shared_memory_gives_tp1s_answers(tiny_llama_dir, monkeypatch, path):
    ps = tiny_prompts(6, seed=3)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128)).generate(ps, greedy)]
    monkeypatch.setenv("PAGEDKV_TP_ALLREDUCE", path)
    with Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, tensor_parallel_size=2)) as eng:
        assert eng.parallel.group.all_reduce_path == {"gloo": "gloo", "shm": "shared memory"}[path]
        assert [o.token_ids for o in eng.generate(ps, greedy)] == ref
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pagedkv-tp-{os.getpid()}-")]


def test_close_and_context_manager_reap_the_workers(tiny_llama_dir):
    with Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, tensor_parallel_size=2)) as eng:
        pids = eng.parallel.worker_pids()
        eng.generate(tiny_prompts(2), SamplingParams(max_tokens=3))
    assert wait_gone(pids, 5) == []
    assert [p.exitcode for p in eng.parallel.procs.values()] == [0]
    with pytest.raises(RankFailed, match="closed"):
        eng.step() if eng.has_unfinished() else eng.generate(tiny_prompts(1), SamplingParams(max_tokens=2))


SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from workbench import Engine, EngineConfig, SamplingParams
    from workbench.engine import instrumentation
    if __name__ == "__main__":
        mode, path = sys.argv[1], sys.argv[2]
        eng = Engine.from_pretrained(path, EngineConfig(num_pages=512, tensor_parallel_size=2))
        print("pids", *eng.parallel.worker_pids(), flush=True)
        ps = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7]
        if mode == "driver-dies":
            eng.generate(ps, SamplingParams(max_tokens=3))
            os.kill(os.getpid(), signal.SIGKILL)
        class Slow(instrumentation.ModelTap):   # the driver spends its time inside the forward, as SmolLM2's does
            needs = frozenset({"kv"})           # (tensor parallel keeps every row whatever the taps read)
            def on_kv(self, layer, k, v, batch):
                if layer == 0:
                    time.sleep(0.05)
        instrumentation.add_tap(eng, Slow())
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            eng.generate(ps, SamplingParams(max_tokens=500, ignore_eos=True))
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted:", eng.parallel.broken, flush=True)
        try:
            eng.generate(ps, SamplingParams(max_tokens=2))
        except Exception as e:
            print("then:", type(e).__name__, e, flush=True)
""")


def _run_script(mode, path, tmp_path):
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode, str(path)], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)


def test_interrupted_driver_shuts_its_ranks_down(tiny_llama_dir, tmp_path):
    out = _run_script("interrupt", tiny_llama_dir, tmp_path)
    pids = [int(p) for p in out.stdout.split("pids", 1)[1].split("\n", 1)[0].split()]
    assert "interrupted: interrupted during step" in out.stdout, out.stdout + out.stderr
    assert "then: RankFailed tensor-parallel engine is unusable: interrupted during step" in out.stdout
    assert out.returncode == 0, out.stderr
    assert wait_gone(pids, 5) == []


def test_dead_driver_takes_its_ranks_with_it(tiny_llama_dir, tmp_path):
    out = _run_script("driver-dies", tiny_llama_dir, tmp_path)
    assert out.returncode == -signal.SIGKILL
    pids = [int(p) for p in out.stdout.split("pids", 1)[1].split("\n", 1)[0].split()]
    assert pids and wait_gone(pids, 10) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_launch_two_processes(tiny_llama_dir):
    prompts = tiny_prompts(3, seed=5)
    ref = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "workbench.serve", "--model", str(tiny_llama_dir),
           "--max-tokens", "8", "--ignore-eos", "--num-pages", "128", "--probe", "rank_consistency"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    outs = [ln for ln in lines if "token_ids" in ln]
    assert [o["token_ids"] for o in outs] == [o.token_ids for o in ref]
    assert [ln for ln in lines if "finding" in ln] == []


def digest_that_fails_on_workers(view):
    """A per-step tap (imported by module path on every rank) whose worker side raises."""
    if view.rank:
        raise ValueError("boom on a worker")
    return [view.step] * 9


def test_a_failing_tap_or_probe_never_breaks_the_ranks(tiny_llama_dir):
    with Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, tensor_parallel_size=2)) as eng:
        seen = []
        eng.parallel.add_tap("t", f"{__name__}:digest_that_fails_on_workers", 9, lambda *a: seen.append(a))
        out = eng.generate(tiny_prompts(2), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert seen and all((d[1] == -1).all() and (d[0] != -1).all() for _, d, _ in seen)
        assert "boom on a worker" in eng.parallel.store.get("error/tap/1").decode()
        eng.parallel.remove_tap("t")
        # the probe turns the same failure into a probe-error finding, and the engine carries on
        wb = Workbench(eng, log=False).attach("rank_consistency")
        eng.parallel.add_tap("rank_consistency", f"{__name__}:digest_that_fails_on_workers", 9,
                             wb.probe("rank_consistency").guard(wb.probe("rank_consistency").on_digests))
        again = eng.generate(tiny_prompts(2), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in again] == [o.token_ids for o in out]
        kinds = {f.kind for f in wb.all_findings()}
        assert kinds == {"probe-error"} and eng.parallel.broken is None
        wb.detach()


# ---- the view and the house rules ------------------------------------------------------------------
def test_dashboard_shows_a_rank_strip_for_tp_only(tiny_llama_dir):
    from workbench.widgets.dashboard import Dashboard
    one = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    wb1 = Workbench(one)
    d1 = Dashboard.from_workbench(wb1, live=False)
    assert d1.ranks is None
    d1.close()
    with Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, tensor_parallel_size=2)) as eng:
        wb = Workbench(eng)
        eng.generate(tiny_prompts(3), SamplingParams(max_tokens=5))
        d = Dashboard.from_workbench(wb, live=False)
        html = d.ranks.widget.value
        assert "rank 0" in html and "rank 1" in html and "agrees" in html and "DIFFERS" not in html
        assert d.ranks.widget in d.widget.children[3].children            # beside the page map
        d.close()


def test_parallel_machinery_imports_no_consumer():
    code = textwrap.dedent("""
        import sys
        from workbench.engine.parallel import driver, worker, shard, group, plan_broadcast
        import workbench.serve
        bad = sorted(m for m in sys.modules if m.startswith(("workbench.trace", "workbench.widgets",
                     "workbench.export", "probes")))
        print(",".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""
