"""Bandwidth, leak and pool probes, and the faults they catch: slow_page_size, buffer_leak,
pool_pressure. Each fault is shown real (slower steps / growing memory / preemptions), caught
within a bounded number of steps, named, and undone; the same runs without it stay quiet."""
import math
import time

import numpy as np
import pytest
import torch

from probes.bandwidth import read_msprof_hbm
from probes.leak import register_buffer
from probes.pool import advise_pool_size
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine.attention import TorchFallbackAttention, TorchPagedAttention, get_backend
from workbench.engine.kv_manager import pages_for
from workbench.events import StepFinished
from workbench.faults.pool_pressure import long_tail_prompts

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model gains nothing from a second thread, and on a shared 2-core machine
    OpenMP barriers between starved threads make every step many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Peaks and bandwidth baselines in a folder of this test's own, not the machine's cache."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))


def loud(wb, severity="warn"):
    return [(f.probe, f.kind, f.message) for f in wb.findings_at_least(severity)]


def tiny(path, **cfg):
    cfg.setdefault("enable_prefix_caching", False)
    return Engine.from_pretrained(path, EngineConfig(**cfg))


# ---- bandwidth --------------------------------------------------------------------------
def test_bandwidth_rows_from_step_events_against_measured_peak(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    eng = tiny(tiny_llama_dir, num_pages=128)
    wb = Workbench(eng).attach("bandwidth", bandwidth={"peak_nbytes": 1 << 20})
    p = wb.probe("bandwidth")
    assert p.peak_gbs > 0 and (tmp_path / "peaks.json").exists()      # measured once, cached
    wb.run([[5, 6, 7] * 10, [9] * 40], SamplingParams(max_tokens=6, ignore_eos=True))
    df, steps = p.frame(), wb.log.frame("StepFinished")
    assert list(df["step"]) == list(steps["step"])
    moved = steps["bytes_weights"] + steps["bytes_kv_read"] + steps["bytes_kv_written"]
    assert (df["bytes"].values == moved.values).all()
    assert np.allclose(df["gbs"], moved / (steps["duration_ns"] / 1e9) / 1e9)
    assert np.allclose(df["share_of_peak"], df["gbs"] / p.peak_gbs)
    assert list(df["decode_only"]) == [False] + [True] * 5 and list(df["tokens"]) == [70] + [2] * 5
    assert not df["judged"].any()          # a tiny model moves too few bytes to be bandwidth bound
    assert loud(wb) == []


def test_share_of_peak_is_information_not_the_verdict(tiny_llama_dir):
    """A roof no step comes near (a peak cached on another day, a copy benchmark small-batch decode is
    not bound by) makes every step a tiny share of it: a column, never a finding. Steps of a shape
    are judged against what this engine reached for it (tests/test_probe_bandwidth_baseline.py)."""
    eng = tiny(tiny_llama_dir, num_pages=128)
    prompts = [[5, 6, 7] * 10, [9] * 40]
    wb = Workbench(eng, log=False).attach("bandwidth", bandwidth=dict(peak_gbs=1e9, min_bytes=0, window=8))
    for _ in range(3):
        wb.run(prompts, GREEDY)
    df = wb.probe("bandwidth").frame()
    assert (df["share_of_peak"] < 1e-6).all() and (df["peak_gbs"] == 1e9).all()
    judged = df[df["judged"]]
    # against the baseline (~1), not the roof (~1e-9); sub-millisecond steps on a busy host move it by tens of %
    assert len(judged) > 20 and judged["vs_baseline"].median() > 0.3
    assert wb.findings.empty
    wb.detach()


HBM = ("Device_id,Metric,Read(MB/s),Write(MB/s)\n"
       "0,0,1200.5,300.25\n"
       "0,1,1100.0,N/A\n"
       "\n"
       "1,0,900,100\n")


def test_read_msprof_hbm_dir_and_bad_rows(tmp_path):
    d = tmp_path / "PROF_1" / "device_0" / "summary"
    d.mkdir(parents=True)
    (d / "hbm_0_1_20240101.csv").write_text(HBM)
    df = read_msprof_hbm(tmp_path)
    assert list(df["device_id"]) == [0, 0, 1] and list(df["metric"]) == ["0", "1", "0"]
    assert list(df["line"]) == [2, 3, 5]
    assert df["read_mbs"].iloc[0] == 1200.5 and math.isnan(df["write_mbs"].iloc[1])
    assert df["total_gbs"].iloc[2] == pytest.approx(1.0)
    bad = tmp_path / "hbm_bad.csv"
    bad.write_text("Device_id,Metric,Read(MB/s),Write(MB/s)\n0,0,1,2\n0,1,fast,2\n")
    with pytest.raises(ValueError, match=r"hbm_bad\.csv:3: Read\(MB/s\) is 'fast'"):
        read_msprof_hbm(bad)
    bad.write_text("Device_id,Metric,Read(MB/s),Write(MB/s)\n0,0,1\n")
    with pytest.raises(ValueError, match=r"hbm_bad\.csv:2: 3 fields"):
        read_msprof_hbm(bad)
    bad.write_text("Device,Metric,Read(MB/s),Write(MB/s)\n0,0,1,2\n")
    with pytest.raises(ValueError, match=r"hbm_bad\.csv:1: .*lacks \['Device_id'\]"):
        read_msprof_hbm(bad)
    with pytest.raises(FileNotFoundError):
        read_msprof_hbm(tmp_path / "PROF_1" / "device_0" / "nothing_here")


def test_get_backend_picks_the_fallback_for_odd_page_sizes():
    assert isinstance(get_backend("cpu", 4, 2, 16, page_size=12), TorchFallbackAttention)
    from workbench.engine.attention import CpuPagedAttention, native
    paged = CpuPagedAttention if native.kernel() is not None else TorchPagedAttention
    assert type(get_backend("cpu", 4, 2, 16, page_size=16)) is paged
    assert type(get_backend("cpu", 4, 2, 16)) is paged
    assert type(get_backend("cuda", 4, 2, 16)) is TorchPagedAttention


def test_fallback_attention_equals_paged_attention_at_page_size_12():
    """Mixed step: decodes of different lengths, a fresh prefill, a chunk after cached pages."""
    from workbench.engine.batch import BatchBuilder
    from workbench.engine.sequence import Sequence
    ps, hq, hkv, d = 12, 6, 2, 32
    specs = [(40, 1), (7, 1), (130, 1), (0, 50), (36, 29)]           # (tokens cached, tokens this step)
    total = sum(pages_for(a + n, ps) for a, n in specs)
    perm = np.random.default_rng(0).permutation(total + 5).tolist()  # pages scattered over the pool
    kc, vc = torch.randn(total + 5, ps, hkv, d), torch.randn(total + 5, ps, hkv, d)
    sched = []
    for i, (a, n) in enumerate(specs):
        s = Sequence(i, list(range(a + n)), SamplingParams(), max_len=a + n + 1)
        s.pages, s.num_computed_tokens = [perm.pop() for _ in range(pages_for(a + n, ps))], a
        sched.append((s, n))
    t = sum(n for _, n in specs)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    outs = []
    fb = TorchFallbackAttention(hq, hkv, d)
    fb.query_chunk = 16                                               # prefills split into score chunks
    for backend in (TorchPagedAttention(hq, hkv, d), fb):
        batch = BatchBuilder(1024, 8, 32, ps, torch.device("cpu")).build(sched)
        kcc, vcc = kc.clone(), vc.clone()
        backend.write_kv(k, v, kcc, vcc, batch)
        outs.append(backend.forward(q, k, v, kcc, vcc, batch))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert fb.bytes_moved > 0 and batch.attn_plan.pages_read == sum(pages_for(a + n, ps) for a, n in specs
                                                                   if n == 1 or a > 0)


def test_fallback_engine_answers_like_the_paged_one_with_scaled_fp16_pages(tiny_llama_dir):
    prompts = long_tail_prompts(4, seed=5, median=40, p99=150, max_len=200)
    outs = []
    for ps in (16, 12):
        eng = tiny(tiny_llama_dir, num_pages=128, page_size=ps, allow_unsupported_page_size=True,
                   kv_cache_dtype="fp16_scaled")
        outs.append([o.token_ids for o in eng.generate(prompts, GREEDY)])
    assert eng.attn.name == "torch-fallback" and outs[0] == outs[1]


# ---- slow_page_size -------------------------------------------------------------------------
def test_slow_page_size_caught_by_config_check_and_undone(tiny_llama_dir):
    eng = tiny(tiny_llama_dir, num_pages=256)
    prompts = long_tail_prompts(6, seed=2, median=40, p99=200, max_len=300)
    wb = Workbench(eng, log=False).attach("bandwidth", bandwidth={"peak_gbs": 30.0})
    ref = [o.token_ids for o in wb.run(prompts, GREEDY)]
    assert loud(wb) == []
    pool, attn, first = eng.pool, eng.attn, eng.step_count + 1
    with faults.inject(eng, "slow_page_size"):
        assert eng.config.page_size == 12 and eng.attn.name == "torch-fallback"
        assert eng.num_pages == 256 * 16 // 12                      # the same KV memory
        outs = wb.run(prompts, GREEDY)
        # Live requests when the fault is switched off are recomputed on the old pool.
        for p in prompts[:3]:
            eng.add_request(p, GREEDY)
        for _ in range(3):
            eng.step()
    assert [o.token_ids for o in outs] == ref                        # slower, not wrong
    (f,) = wb.findings_at_least("error")
    assert f.kind == "page-size" and "page_size=12" in f.message and "torch-fallback" in f.message
    assert "16, 32, 64 or 128" in f.hint and f.step == first
    assert eng.pool is pool and eng.attn is attn and eng.config.page_size == 16 and eng.num_pages == 256
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [done[k] for k in sorted(done)] == ref[:3]
    assert eng.pool.num_used == 0
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref


def test_config_check_at_attach_and_repaging_needs_an_idle_engine(tiny_llama_dir):
    odd = tiny(tiny_llama_dir, num_pages=64, page_size=24, allow_unsupported_page_size=True)
    assert odd.attn.name == "torch-fallback"
    wb = Workbench(odd, log=False).attach("bandwidth", bandwidth={"peak_gbs": 30.0})
    (f,) = wb.findings_at_least("error")                              # before any step
    assert f.kind == "page-size" and f.step == 0 and "page_size=24" in f.hint
    eng = tiny(tiny_llama_dir, num_pages=64)
    eng.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        with faults.inject(eng, "slow_page_size"):
            pass
    assert eng.config.page_size == 16 and len(eng.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 24


def test_slow_page_size_moves_more_bytes_and_runs_slower(tiny_llama_dir):
    """Same requests, both engines interleaved in one run; CPU time (one thread), so a loaded
    machine does not count against whichever engine ran during a burst."""
    prompts = long_tail_prompts(16, seed=3, median=64, p99=400, max_len=600)
    fast, slow = tiny(tiny_llama_dir, num_pages=512), tiny(tiny_llama_dir, num_pages=512)
    wf = Workbench(fast, log=False).attach("bandwidth", bandwidth=dict(peak_gbs=30.0, min_bytes=0))
    ws = Workbench(slow, log=False).attach("bandwidth", bandwidth=dict(peak_gbs=30.0, min_bytes=0))
    with faults.inject(slow, "slow_page_size"):
        cpu = {"fast": [], "slow": []}
        for _ in range(3):
            for name, eng in (("fast", fast), ("slow", slow)):
                t = time.process_time()
                outs = eng.generate(prompts, GREEDY)
                cpu[name].append(time.process_time() - t)
                assert len(outs) == 16
        moved = slow.attn.bytes_moved
    assert min(cpu["slow"]) > 1.4 * min(cpu["fast"]), cpu
    df_f, df_s = wf.probe("bandwidth").frame(), ws.probe("bandwidth").frame()
    assert df_f["tokens"].sum() == df_s["tokens"].sum()
    # The paged kernel reads the context pages; the fallback gathers far more per token.
    assert moved / df_s["tokens"].sum() > 2 * df_f["bytes_kv_read"].sum() / df_f["tokens"].sum()
    dec_f, dec_s = df_f[df_f["decode_only"]], df_s[df_s["decode_only"]]
    assert dec_s["share_of_peak"].median() < dec_f["share_of_peak"].median()


# ---- buffer_leak ------------------------------------------------------------------------------
def trim_heap():
    """Hand free heap pages back to the OS (glibc), so RssAnon measures new memory rather than
    chunks that earlier tests freed and the leak would silently reuse."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


LEAK = dict(every=1, window=16, min_growth_bytes=4 << 20, retain_window=16, census_every=8, min_tensor_growth=32)


def test_buffer_leak_named_memory_really_grows_and_is_freed(tiny_llama_dir):
    # A big token budget: the leaked per-step workspace is ~0.4 MB, as a runtime sized for it would.
    eng = tiny(tiny_llama_dir, num_pages=256, max_num_batched_tokens=16384)
    prompts = long_tail_prompts(8, seed=1, median=24, p99=200, max_len=300)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in eng.generate(prompts, params)]       # warm-up: shapes, caches
    wb = Workbench(eng, log=False).attach("leak", leak=LEAK)
    wb.run(prompts, params)
    assert loud(wb) == []
    assert wb.probe("leak").frame()["retained_tensors"].max() == 0
    wb.reset()
    trim_heap()
    first = eng.step_count + 1
    with faults.inject(eng, "buffer_leak") as fault:
        outs = wb.run(prompts, params)
        leaked = fault.retained_bytes
    assert [o.token_ids for o in outs] == ref
    df = wb.probe("leak").frame()
    assert df["host_bytes"].iloc[-1] - df["host_bytes"].iloc[0] > 0.5 * leaked > 4 << 20     # RssAnon rose
    assert df["retained_bytes"].iloc[-1] > 0.7 * leaked
    errors = {f.kind: f for f in wb.findings_at_least("error")}
    ret = errors["retained-step-tensors"]
    assert "cu_seqlens_q" in ret.message and "BufferLeak.retained" in ret.message
    assert ret.step - first <= LEAK["retain_window"] + 4
    assert "cu_seqlens" in errors["memory-growth"].message and "RssAnon" in errors["memory-growth"].message
    assert "preallocated buffer" in ret.hint
    # Off again: the builder is the engine's own, the retained tensors are gone.
    assert "build" not in vars(eng.builder) and fault.retained == []
    wb.run(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert wb.probe("leak").frame()["retained_tensors"].iloc[-1] == 0


def test_leak_probe_names_a_registered_buffer_that_grows(tiny_llama_dir):
    eng = tiny(tiny_llama_dir, num_pages=64)
    grows: list = []
    register_buffer(eng, "trace_ring", grows)
    wb = Workbench(eng, log=False).attach("leak", leak=dict(LEAK, window=8, min_growth_bytes=2 << 20))
    eng.bus.subscribe(StepFinished, lambda e: grows.append(torch.ones(1 << 18)))     # 1 MiB a step
    wb.run([[5, 6, 7] * 5], SamplingParams(max_tokens=12, ignore_eos=True))
    f = next(f for f in wb.findings_at_least("error") if f.kind == "engine-buffer-growth")
    assert "'trace_ring'" in f.message and f.evidence["growth_bytes"] >= 6 << 20


# ---- pool --------------------------------------------------------------------------------------
def test_advise_pool_size_rule():
    # P99 of 1..100 is 99.01: ceil(8 x 99.01 / 16) = 50 pages, x 1.3 = 65
    assert advise_pool_size(range(1, 101), 8, 16) == 65
    assert advise_pool_size([512] * 99 + [4000], 1, 16) > advise_pool_size([512] * 100, 1, 16)
    assert advise_pool_size([100], 16, 16) < advise_pool_size([100], 32, 16)
    with pytest.raises(ValueError):
        advise_pool_size([], 4, 16)


def test_pool_frame_waste_sharing_and_contiguous_counterfactual(tiny_llama_dir):
    eng = tiny(tiny_llama_dir, num_pages=128, enable_prefix_caching=True, max_model_len=512)
    wb = Workbench(eng, log=False).attach("pool")
    prefix = list(range(10, 58))                                   # 48 tokens: 3 full pages
    eng.add_request(prefix + [3, 4, 5], GREEDY)
    eng.step()                                                     # its prefix pages are now cached
    for tail in ([6, 7], [8, 9, 10, 11]):
        eng.add_request(prefix + tail, GREEDY)
    while eng.has_unfinished():
        eng.step()
        row = wb.probe("pool").frame().iloc[-1]
        live = eng.scheduler.running
        assert row["pages_used"] == eng.pool.num_used and row["live_seqs"] == len(live)
        assert row["waste_slots"] == sum(len(s.pages) * 16 - s.num_computed_tokens for s in live)
        assert row["contiguous_max_len_pages"] == len(live) * 32
        assert row["contiguous_request_pages"] == sum(pages_for(s.max_len, 16) for s in live)
    df = wb.probe("pool").frame()
    assert df["shared_saved_pages"].max() == 6                      # 2 requests x 3 shared pages
    assert (df["unmapped_pages"] == 0).all() and (df["preemptions"] == 0).all()
    busy = df[df["live_seqs"] == 3]
    assert (busy["pages_used"] < busy["contiguous_request_pages"]).all()
    assert (busy["paged_vs_max_len"] < 0.3).all()
    assert loud(wb) == []


def test_pool_pressure_storms_and_is_caught_with_sizing_hint(tiny_llama_dir):
    eng = tiny(tiny_llama_dir, num_pages=128)
    prompts = long_tail_prompts(12, seed=1, median=24, p99=200, max_len=220)
    wb = Workbench(eng, log=False).attach("pool", pool=dict(storm_threshold=3))
    ref = [o.token_ids for o in wb.run(prompts, GREEDY)]
    assert loud(wb) == [] and eng.stats()["num_preemptions"] == 0
    wb.reset()
    first = eng.step_count + 1
    with faults.inject(eng, "pool_pressure", usable=0.15) as fault:
        assert eng.pool.num_free == 128 - len(fault.reserved) == 19
        outs = wb.run(prompts, GREEDY)
    assert eng.stats()["num_preemptions"] > 0                      # the symptom, real
    assert [o.token_ids for o in outs] == ref                      # recompute keeps answers right
    kinds = {f.kind: f for f in wb.findings_at_least("warn")}
    usage = kinds["pool-usage"]
    assert usage.severity == "error" and usage.step - first <= 5 and usage.evidence["usage"] > 0.95
    assert "EngineConfig(num_pages=" in usage.hint and "19 of them usable" in usage.hint
    # By the end it has seen every request: the rule over their real lengths and the 12 that came at once.
    assert wb.probe("pool").sizing()["pages"] == advise_pool_size([len(p) + 24 for p in prompts], 12, 16)
    assert kinds["preemption-storm"].request_id is not None
    assert kinds["pool-unmapped-pages"].evidence["unmapped_pages"] == 109
    assert eng.pool.num_free == 128 and fault.reserved == []       # pages given back
