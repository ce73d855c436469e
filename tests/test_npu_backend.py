"""The npu attention backend on torch_npu's paged ops, run on the CPU through the contract-checking
double (workbench/engine/attention/npu_double.py).

- the double: installed as torch_npu and undone; its results against dense attention; each
  documented constraint refused with the argument named; a block id past the pool read as
  device memory (no raise) and caught by the page-table probe;
- the config: every constraint the ops document refused at EngineConfig / build time;
- the real default model (SmolLM2-135M) in bfloat16: greedy tokens equal the torch backend's
  (prefix-cache hits, chunked prefill and mixed steps included; a flip only at a bf16 tie),
  teacher-forced logits within bf16 error of the float32 reference, the packing probe silent;
- every fault that touches attention reproduces on the npu backend and is caught.
"""
import math
import sys

import numpy as np
import pytest
import torch

from workbench import ConfigError, Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine import device
from workbench.engine.attention import NpuPagedAttention, get_backend, npu_double
from workbench.engine.attention.npu import NpuPlan
from workbench.engine.weights import default_model_path, load_model
from workbench.events import BatchPacked


@pytest.fixture(scope="module", autouse=True)
def double():
    """torch_npu is the CPU double for this module, and only for it."""
    mod = npu_double.install()
    yield mod
    npu_double.uninstall()


@pytest.fixture(scope="module", autouse=True)
def bf16_arithmetic():
    """The torch-backend references of this module compute in bf16, as the NPU's ops do (on a CPU
    without native bf16 the engine would otherwise compute bf16 weights in fp32: cpu_bf16.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_BF16", "native")
        yield


def loud(wb, severity="warn"):
    return [(f.kind, f.message) for f in wb.findings_at_least(severity)]


# ---- the double itself ---------------------------------------------------------------------------
def test_double_stands_in_for_torch_npu_and_is_undone(double, monkeypatch):
    import torch_npu
    assert torch_npu is double and torch_npu.IS_DOUBLE and torch_npu.__version__.startswith("double-")
    assert device._import_torch_npu() is double and not device.npu_available()   # no device pretended
    assert "CPU double" in device._why_unavailable("npu")
    npu_double.uninstall()
    try:
        assert "torch_npu" not in sys.modules and not npu_double.installed()
        monkeypatch.delenv("PAGEDKV_NPU_DOUBLE", raising=False)
        assert device._import_torch_npu() is None                 # no real torch_npu here, no double asked
        with pytest.raises(ConfigError, match="PAGEDKV_NPU_DOUBLE=1"):
            EngineConfig(attention_backend="npu", dtype="bfloat16")
        with pytest.raises(ConfigError, match="install torch_npu"):
            NpuPagedAttention(4, 2, 16)
        monkeypatch.setenv("PAGEDKV_NPU_DOUBLE", "1")             # the user's switch installs it
        assert device._import_torch_npu() is double and npu_double.installed()
    finally:
        npu_double.install()


def paged_case(seed=0, ctx=(40, 17, 64), q_lens=(1, 5, 16), bs=16, hq=4, hkv=2, d=16, dtype=torch.bfloat16):
    """Caches holding each sequence's context in scattered pages, its queries the last q_len positions."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctx]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g)[: sum(need)].tolist()
    table = torch.zeros(len(ctx), max(need) + 1, dtype=torch.int32)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[at:at + n])
        at += n
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    return q, kc, vc, table, list(ctx), list(q_lens)


def dense(q, kc, vc, table, ctx, q_lens, scale):
    """Causal attention of each sequence's queries over its pages, in float64 (bottom-right aligned)."""
    bs, out, at = kc.shape[1], [], 0
    for i, (c, n) in enumerate(zip(ctx, q_lens)):
        pages = table[i, : -(-c // bs)].long()
        k = kc[pages].reshape(-1, *kc.shape[2:])[:c].double().repeat_interleave(q.shape[1] // kc.shape[2], 1)
        v = vc[pages].reshape(-1, *vc.shape[2:])[:c].double().repeat_interleave(q.shape[1] // kc.shape[2], 1)
        s = torch.einsum("nhd,chd->hnc", q[at:at + n].double(), k) * scale
        s = s.masked_fill(torch.arange(c)[None, :] > (c - n + torch.arange(n))[:, None], float("-inf"))
        out.append(torch.einsum("hnc,chd->nhd", s.softmax(-1), v))
        at += n
    return torch.cat(out)


def fia(torch_npu, q, kc, vc, table, ctx, q_lens, **kw):
    nb, bs = kc.shape[:2]
    args = dict(atten_mask=torch.triu(torch.ones(2048, 2048), 1).to(torch.int8), block_table=table,
                input_layout="TND", block_size=bs, actual_seq_lengths=np.cumsum(q_lens).tolist(),
                actual_seq_lengths_kv=ctx, num_key_value_heads=kc.shape[2], num_heads=q.shape[1],
                scale=q.shape[2] ** -0.5, sparse_mode=3)
    args.update(kw)
    return torch_npu.npu_fused_infer_attention_score(q, kc.view(nb, bs, -1), vc.view(nb, bs, -1), **args)


def test_double_computes_paged_attention_and_writes_slots(double):
    q, kc, vc, table, ctx, q_lens = paged_case()
    ref = dense(q, kc, vc, table, ctx, q_lens, 16 ** -0.5)
    out, lse = fia(double, q, kc, vc, table, ctx, q_lens)
    assert out.dtype == torch.bfloat16 and lse.shape == (1,)
    assert (out.double() - ref).abs().max() < 2e-2                   # bf16 output rounding only
    out2, lse = fia(double, q, kc, vc, table, ctx, q_lens, softmax_lse_flag=True)
    assert lse.shape == (q.shape[0], 4, 1) and torch.isfinite(lse).all() and (out2.double() - ref).abs().max() < 2e-2
    # decode: one query per sequence, through the paged-attention op
    qd = q[torch.tensor(np.cumsum(q_lens) - 1)]
    o = torch.empty_like(qd)
    double._npu_paged_attention(qd, kc, vc, 2, 4, 16 ** -0.5, table, torch.tensor(ctx, dtype=torch.int32), o)
    assert (o.double() - dense(qd, kc, vc, table, ctx, [1, 1, 1], 16 ** -0.5)).abs().max() < 2e-2
    # both K/V stores put the same rows at the same slots; a negative slot is padding, skipped
    key, value = torch.randn(3, 2, 16).to(torch.bfloat16), torch.randn(3, 2, 16).to(torch.bfloat16)
    slots = torch.tensor([5, 40, -1], dtype=torch.int32)
    a = [kc.clone(), vc.clone()]
    b = [kc.clone(), vc.clone()]
    double._npu_reshape_and_cache(key, value, a[0], a[1], slots)
    double.npu_scatter_pa_kv_cache(key, value, b[0], b[1], slots.long(), cache_mode="Norm")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0].view(-1, 2, 16)[40], key[1]) and torch.equal(a[0].view(-1, 2, 16)[0], kc.view(-1, 2, 16)[0])


def test_an_out_of_range_block_id_reads_device_memory(double):
    q, kc, vc, table, ctx, q_lens = paged_case(q_lens=(1, 1, 1))
    table[1, 0] = kc.shape[0]                                         # one id past the pool
    o = torch.empty_like(q)
    double._npu_paged_attention(q, kc, vc, 2, 4, 0.25, table, torch.tensor(ctx, dtype=torch.int32), o)   # no raise
    assert torch.isnan(o[1]).all() and torch.isfinite(o[[0, 2]]).all()
    out, _ = fia(double, q, kc, vc, table, ctx, q_lens)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


def bad_calls():
    """(what, the argument the message must name, a call that breaks one documented rule)."""
    def pa(**kw):
        def call(d):
            q, kc, vc, table, ctx, _ = paged_case(q_lens=(1, 1, 1))
            args = dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, num_heads=4, scale_value=0.25,
                        block_table=table, context_lens=torch.tensor(ctx, dtype=torch.int32), out=torch.empty_like(q))
            args.update({k: f(args) for k, f in kw.items()})
            d._npu_paged_attention(**args)
        return call

    def fa(**kw):
        def call(d):
            q, kc, vc, table, ctx, q_lens = paged_case()
            fixed = {k: f(q) for k, f in kw.items() if k == "q"}
            fia(d, fixed.get("q", q), kc, vc, table, ctx, q_lens, **{k: f for k, f in kw.items() if k != "q"})
        return call

    def rc(slots_dtype=torch.int32, **kw):
        def call(d):
            _, kc, vc, _, _, _ = paged_case()
            key, value = torch.randn(3, 2, 16).to(torch.bfloat16), torch.randn(3, 2, 16).to(torch.bfloat16)
            d._npu_reshape_and_cache(key, value, kc, vc, torch.tensor([1, 2, 3], dtype=slots_dtype))
        return call

    def sc(**kw):
        def call(d):
            _, kc, vc, _, _, _ = paged_case()
            key, value = torch.randn(3, 2, 16).to(torch.bfloat16), torch.randn(3, 2, 16).to(torch.bfloat16)
            d.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([1, 2, 3], dtype=torch.int32), **kw)
        return call

    b8 = paged_case(bs=8)
    return [
        ("slot indices int64", "slot_indices", rc(torch.int64)),
        ("slot indices float", "slot_indices", rc(torch.float32)),
        ("scatter in the NZ default mode", "cache_mode", sc()),
        ("block_table int64", "block_table", pa(block_table=lambda a: a["block_table"].long())),
        ("context_lens int64", "context_lens", pa(context_lens=lambda a: a["context_lens"].long())),
        ("float32 query", "query", pa(query=lambda a: a["query"].float())),
        ("out of another dtype", "out", pa(out=lambda a: a["out"].half())),
        ("out of another shape", "out", pa(out=lambda a: a["out"][:2])),
        ("block_size 8 caches (decode)", "block_size", pa(key_cache=lambda a: b8[1], value_cache=lambda a: b8[2])),
        ("head_size 272 > 256", "key_cache", pa(query=lambda a: torch.zeros(3, 4, 272, dtype=torch.bfloat16),
                                               key_cache=lambda a: torch.zeros(8, 16, 2, 272, dtype=torch.bfloat16),
                                               value_cache=lambda a: torch.zeros(8, 16, 2, 272, dtype=torch.bfloat16),
                                               out=lambda a: torch.zeros(3, 4, 272, dtype=torch.bfloat16))),
        ("num_heads not a multiple of num_kv_heads", "num_kv_heads", pa(num_kv_heads=lambda a: 3)),
        ("block_size 8 (prefill)", "block_size", fa(block_size=8)),
        ("non-monotone actual_seq_lengths", "actual_seq_lengths[1]", fa(actual_seq_lengths=[6, 1, 22])),
        ("last actual_seq_lengths != T", "actual_seq_lengths[-1]", fa(actual_seq_lengths=[1, 6, 21])),
        ("one kv length too few", "actual_seq_lengths_kv", fa(actual_seq_lengths_kv=[40, 17])),
        ("non-contiguous query", "query", fa(q=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1))),
        ("float32 query (prefill)", "query", fa(q=lambda q: q.float())),
        ("int64 block_table (prefill)", "block_table", fa(block_table=paged_case()[3].long())),
        ("a layout it does not take", "input_layout", fa(input_layout="BSND")),
        ("causal without the mask", "atten_mask", fa(atten_mask=None)),
        ("a mask of the wrong size", "atten_mask", fa(atten_mask=torch.ones(64, 64, dtype=torch.bool))),
        ("a sparse mode TND does not take", "sparse_mode", fa(sparse_mode=2)),
        ("a block table too narrow", "block_table", fa(block_table=paged_case()[3][:, :2])),
    ]


@pytest.mark.parametrize("what, arg, call", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_the_double_refuses_what_the_op_refuses(double, what, arg, call):
    with pytest.raises(RuntimeError) as e:
        call(double)
    msg = str(e.value)
    assert f" {arg} " in msg and "the op requires" in msg, msg


def test_a_4d_cache_must_be_viewed_as_the_op_reads_it(double):
    q, kc, vc, table, ctx, q_lens = paged_case()
    with pytest.raises(RuntimeError, match=r"key .*\[num_blocks, KV_N=2, block_size, D=16\]"):
        double.npu_fused_infer_attention_score(
            q, kc, vc, atten_mask=torch.triu(torch.ones(2048, 2048), 1).to(torch.int8), block_table=table,
            input_layout="TND", block_size=16, actual_seq_lengths=np.cumsum(q_lens).tolist(),
            actual_seq_lengths_kv=ctx, num_key_value_heads=2, num_heads=4, scale=0.25, sparse_mode=3)


# ---- selection and config constraints -------------------------------------------------------------
def test_selection_follows_the_choice_and_the_device():
    assert get_backend("npu", 4, 2, 16).name == "npu"                # auto on an NPU device
    assert get_backend("cpu", 4, 2, 16, page_size=128, choice="npu").name == "npu"
    assert get_backend("cpu", 4, 2, 16, page_size=48, choice="npu").name == "npu"   # a multiple of 16 suffices
    assert get_backend("cpu", 4, 2, 16, page_size=12, choice="npu").name == "torch-fallback"
    assert get_backend("cpu", 4, 2, 16, choice="torch").name == "torch"
    assert get_backend("cpu", 4, 2, 16, choice="cpu").name == "cpu"
    assert get_backend("cuda", 4, 2, 16).name == "torch"
    with pytest.raises(ConfigError, match="attention_backend='cpu'"):
        get_backend("cuda", 4, 2, 16, choice="cpu")
    assert EngineConfig(attention_backend="npu", dtype="bfloat16", page_size=48).page_size == 48
    with pytest.raises(ConfigError, match="attention_backend='gpu'"):
        EngineConfig(attention_backend="gpu")


@pytest.mark.parametrize("cfg, words", [
    (dict(), ["dtype='float32'", "float16 / bfloat16", "dtype='bfloat16'"]),
    (dict(dtype="bfloat16", page_size=24), ["page_size=24", "multiple of 16", "128"]),
    (dict(dtype="bfloat16", page_size=1024), ["page_size=1024", "up to 512"]),
    (dict(dtype="float16", kv_cache_dtype="fp16_scaled"), ["kv_cache_dtype='fp16_scaled'", "per-page scale"]),
    (dict(dtype="bfloat16", kv_cache_dtype="float16"), ["kv_cache_dtype='float16'", "one dtype"]),
    (dict(dtype="bfloat16", device="cuda"), ["device='cuda'"]),
])
def test_config_refuses_what_the_ops_refuse(cfg, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(attention_backend="npu", **cfg)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_head_size_over_256_is_refused_at_build(tiny_llama_dir):
    import dataclasses

    from workbench.engine.stack import build_stack
    loaded = load_model(tiny_llama_dir, torch.bfloat16)
    wide = dataclasses.replace(loaded.config, head_dim=272)
    with pytest.raises(ConfigError, match="head_dim=272.*\\(0, 256\\]"):
        build_stack(EngineConfig(attention_backend="npu", dtype="bfloat16"), 16, wide)
    with pytest.raises(ConfigError, match="head_dim=320"):
        NpuPagedAttention(4, 2, 320)


# ---- the real model in bfloat16 ---------------------------------------------------------------------
SYSTEM = ("You are a careful assistant for engineers who run language model inference services on accelerators. "
          "Answer briefly and precisely. When a question is about memory, explain it in terms of pages, blocks and "
          "tokens; when it is about speed, explain it in terms of memory bandwidth and compute. Never invent a "
          "number you do not know: say that you do not know it. Keep every answer to one or two short sentences, "
          "unless the user asks for more detail about paged attention, prefix caching or chunked prefill. If the "
          "question is unclear, ask one short question back before you answer it, and never repeat the question.")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2?", "Name three colors.",
             "Explain paged attention in one sentence.", "Tell me a joke about a cat who lives in Paris.", "Hi",
             "What does a compiler do?"]
CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
NEW = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BUDGET = 64                         # tokens per step: every prompt is prefilled in chunks


@pytest.fixture(scope="module")
def bf16_model():
    return load_model(default_model_path(), torch.bfloat16)


def engine_on(loaded, backend, page_size, **kw):
    return Engine(loaded, EngineConfig(num_pages=4096 // page_size, dtype="bfloat16", page_size=page_size,
                                       attention_backend=backend, max_num_batched_tokens=BUDGET, **kw))


def counted(fn, name, calls):
    def op(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)
    return op


@pytest.fixture(scope="module")
def greedy(bf16_model, double):
    """The 8 chats on the torch backend and on the npu backend (page 128 and 16), with every op call counted."""
    calls = {}
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        for op in ("npu_scatter_pa_kv_cache", "_npu_paged_attention", "npu_fused_infer_attention_score"):
            mp.setattr(double, op, counted(getattr(double, op), op, calls))
        for backend, ps in (("torch", 16), ("npu", 128), ("npu", 16)):
            eng = engine_on(bf16_model, backend, ps)
            wb = Workbench(eng, log=False).attach("packing", "page_table") if backend == "npu" else None
            steps = []
            eng.bus.subscribe(BatchPacked, lambda e, s=steps: s.append((e.num_prefill, e.num_decode)))
            outs = eng.generate(CHATS, NEW)
            runs[(backend, ps)] = dict(engine=eng, outs=outs, steps=steps, wb=wb, plan=eng.last_batch.attn_plan,
                                       calls=dict(calls))
            calls.clear()
    return runs


@pytest.fixture(scope="module")
def scorer(bf16_model):
    """score(backend, ids): the logits at every position of one prompt, teacher-forced in
    one step (the default token budget) at page size 16; engines made, and results kept, on demand."""
    engines, done = {}, {}

    def score(backend, ids):
        key = (backend, tuple(ids))
        if key not in done:
            if backend not in engines:
                engines[backend] = Engine(bf16_model, EngineConfig(num_pages=256, dtype="bfloat16",
                                                                   attention_backend=backend))
            done[key] = engines[backend].score([list(ids)])[0].float()
        return done[key]
    return score


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def test_npu_greedy_tokens_equal_the_torch_backend(greedy, scorer):
    ref = greedy[("torch", 16)]
    prompts = [list(o.prompt_token_ids) for o in ref["outs"]]
    shared = next(k for k in range(min(map(len, prompts))) if len({p[k] for p in prompts}) > 1)
    assert min(map(len, prompts)) > BUDGET and shared > 128           # chunked; a shared prefix past a 128 page
    for ps in (128, 16):
        run = greedy[("npu", ps)]
        eng = run["engine"]
        assert eng.attn.name == "npu" and isinstance(run["plan"], NpuPlan)
        calls = run["calls"]                                           # every op really ran
        assert min(calls.get(op, 0) for op in ("npu_scatter_pa_kv_cache", "_npu_paged_attention",
                                               "npu_fused_infer_attention_score")) > 0, calls
        assert eng.stats()["prefix_cache_hits"] >= 7 * 128             # the system prompt's full pages, reused
        assert any(p and d for p, d in run["steps"])                   # a mixed step: one decode and one prefill call
        assert loud(run["wb"]) == []                                   # packing + page-table probes: the plan is right
        same = 0
        for i, (a, b) in enumerate(zip(ref["outs"], run["outs"])):
            assert len(b.token_ids) == NEW.max_tokens
            if a.token_ids == b.token_ids:
                same += 1
                continue
            # A flip must be a bf16 near-tie: teacher-forced on both backends at the first difference
            # (one step over the whole prefix: the page size does not change the double's sums).
            j = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            ids = list(a.prompt_token_ids) + a.token_ids[:j]
            for backend in ("torch", "npu"):
                last = scorer(backend, ids)[-1]
                la, lb = float(last[a.token_ids[j]]), float(last[b.token_ids[j]])
                assert abs(la - lb) <= 4 * bf16_ulp(max(abs(la), abs(lb))), (ps, i, j, backend, la, lb)
        assert same >= len(CHATS) // 2, (ps, same)


def test_npu_teacher_forced_logits_within_bf16_of_float32(greedy, scorer):
    ref32 = Engine.from_pretrained(default_model_path(), EngineConfig(num_pages=32, attention_backend="torch"))
    ids = list(greedy[("torch", 16)]["outs"][0].prompt_token_ids)     # ~150 tokens: 10 pages of 16
    want = ref32.score([ids])[0]
    base = (scorer("torch", ids) - want).abs().mean()                  # what bf16 itself costs
    got = scorer("npu", ids)
    err = (got - want).abs()
    assert err.mean() <= 1.5 * base, (float(err.mean()), float(base))
    assert err.max() <= 0.08 * want.abs().max(), float(err.max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


# ---- faults on the npu backend (the tiny Llama: its greedy text depends on what attention reads) --------
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def tiny_npu(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 64, "dtype": "bfloat16",
                                                        "attention_backend": "npu", **kw}))


def random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def run(eng, prompts, params=GREEDY):
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return [done[i] for i in ids], ids


PROMPTS = random_prompts((10, 20, 30))


def page_out_of_range(path):
    eng = tiny_npu(path)
    wb = Workbench(eng, log=False).attach("page_table")
    clean, ids = run(eng, PROMPTS)
    assert loud(wb) == []
    eng = tiny_npu(path)
    wb = Workbench(eng, log=False).attach("page_table")
    with faults.inject(eng, "page_out_of_range", request_id=ids[1]) as fault:
        assert eng.attn.page_reader is None                          # no emulation patched in: the double reads it
        bad, _ = run(eng, PROMPTS)
    [hit] = fault.corrupted
    assert bad[1] != clean[1] and bad[0] == clean[0] and bad[2] == clean[2]
    err = wb.findings_at_least("error")[0]
    assert err.kind == "page-out-of-range" and err.severity == "critical"
    assert (err.request_id, err.page, err.step) == (ids[1], eng.pool.num_pages, hit["step"])
    return eng, wb, clean


def stale_binding(path):
    eng = tiny_npu(path)
    clean, _ = run(eng, PROMPTS)
    wb = Workbench(eng, log=False).attach("page_table")
    with faults.inject(eng, "stale_binding") as fault:
        bad, _ = run(eng, PROMPTS)
    assert fault.late_binds > 0 and bad != clean
    errs = [f for f in wb.findings_at_least("error") if f.kind == "stale-binding"]
    assert errs and all(f.evidence["version_read"] < f.evidence["version_current"] for f in errs)
    return eng, wb, clean


def cu_seqlens(params, changed):
    def scenario(path):
        eng = tiny_npu(path)
        clean, _ = run(eng, PROMPTS)
        wb = Workbench(eng, log=False).attach("cu_seqlens")
        with faults.inject(eng, "cu_seqlens_corrupt", **params) as fault:
            bad, _ = run(eng, PROMPTS)
        [c] = fault.corrupted
        assert [b != a for a, b in zip(clean, bad)] == changed
        found = wb.findings_at_least("error")
        assert found and all(f.step == c["step"] for f in found) and found[0].request_id is not None
        return eng, wb, clean
    return scenario


def cu_seqlens_truncated(path):
    # The trailing total dropped: the fused op refuses a last length != T, as the real one does.
    eng = tiny_npu(path)
    wb = Workbench(eng, log=False).attach("cu_seqlens")
    with faults.inject(eng, "cu_seqlens_corrupt", mode="truncate"):
        with pytest.raises(RuntimeError, match=r"actual_seq_lengths\[-1\]"):
            run(eng, PROMPTS)
    assert {f.evidence["rule"] for f in wb.findings_at_least("error")} >= {"total"}
    return None, None, None


def fp16_kv_overflow(path):
    eng = tiny_npu(path, dtype="float16")
    clean, _ = run(eng, PROMPTS)
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    with faults.inject(eng, "fp16_kv_overflow") as fault:
        bad, _ = run(eng, PROMPTS)
    assert bad != clean and sum(t == 0 for out in bad for t in out) > len(PROMPTS)   # NaN logits: token 0
    errors = wb.findings_at_least("error")
    assert {"fp16-kv-overflow", "fp16-nonfinite"} <= {f.kind for f in errors}
    assert min(f.layer for f in errors) == fault.layer
    return eng, wb, clean


def free_while_shared(path):
    def scenario(eng):
        rng = np.random.default_rng(7)
        prefix = rng.integers(3, 256, 48).tolist()
        a = eng.add_request(prefix + rng.integers(3, 256, 8).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
        done = {}
        step = lambda: done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        step()
        b = eng.add_request(prefix + rng.integers(3, 256, 24).tolist(), SamplingParams(max_tokens=40, ignore_eos=True))
        step()
        while a not in done:
            step()
        c = eng.add_request(rng.integers(3, 256, 64).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
        while eng.has_unfinished():
            step()
        return [done[a], done[b], done[c]], b

    eng = tiny_npu(path, num_pages=8)
    clean, _ = scenario(eng)
    eng = tiny_npu(path, num_pages=8)
    wb = Workbench(eng, log=False).attach("page_table")
    with faults.inject(eng, "free_while_shared") as fault:
        bad, b = scenario(eng)
    assert fault.forced and bad[1] != clean[1] and bad[0] == clean[0] and bad[2] == clean[2]
    first = wb.findings_at_least("error")[0]
    assert first.kind == "free-while-mapped" and first.request_id == b
    wb.reset()
    assert scenario(eng)[0] == clean and loud(wb) == []
    return None, None, None


def slow_page_size(path):
    # On the npu backend too, an unsupported page size (12: not a multiple of 16) runs the generic fallback.
    eng = tiny_npu(path, num_pages=128)
    wb = Workbench(eng, log=False).attach("bandwidth", bandwidth={"peak_gbs": 30.0})
    clean, _ = run(eng, PROMPTS)
    with faults.inject(eng, "slow_page_size"):
        assert eng.attn.name == "torch-fallback" and eng.config.page_size == 12
        slow, _ = run(eng, PROMPTS)
    assert eng.attn.name == "npu"
    (f,) = wb.findings_at_least("error")
    assert f.kind == "page-size" and "page_size=12" in f.message
    assert sum(a == b for a, b in zip(clean, slow)) >= 2               # slower, not wrong (bf16 ties aside)
    wb.reset()
    return eng, wb, clean


def buffer_leak(path):
    eng = tiny_npu(path, num_pages=128, max_num_batched_tokens=4096)
    clean, _ = run(eng, PROMPTS)
    leak = dict(every=1, window=16, min_growth_bytes=1 << 40, retain_window=8, census_every=4, min_tensor_growth=8)
    wb = Workbench(eng, log=False).attach("leak", leak=leak)
    with faults.inject(eng, "buffer_leak") as fault:
        leaky, _ = run(eng, PROMPTS)
        assert any(eng.last_batch.attn_plan.block_table.data_ptr() == t.data_ptr() for t in fault.retained)
    assert leaky == clean and fault.retained == []                     # the npu ops read the fresh tables right
    assert "retained-step-tensors" in {f.kind for f in wb.findings_at_least("error")}
    wb.reset()
    return eng, wb, clean


FAULT_SCENARIOS = {
    "page_out_of_range": page_out_of_range,
    "stale_binding": stale_binding,
    "cu_seqlens_corrupt-swap": cu_seqlens({"mode": "swap", "index": 1}, [False, True, True]),
    "cu_seqlens_corrupt-shift": cu_seqlens({"mode": "shift", "index": 1, "delta": 3}, [True, True, False]),
    "cu_seqlens_corrupt-truncate": cu_seqlens_truncated,
    "fp16_kv_overflow": fp16_kv_overflow,
    "free_while_shared": free_while_shared,
    "slow_page_size": slow_page_size,
    "buffer_leak": buffer_leak,
}


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from a second thread; on a shared 2-core machine OpenMP barriers
    between starved threads make its steps tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(FAULT_SCENARIOS))
def test_fault_reproduces_on_the_npu_backend_and_is_caught(sharp_llama_dir, one_thread, name):
    eng, wb, clean = FAULT_SCENARIOS[name](sharp_llama_dir)
    if eng is not None:                                                # undone: the same engine runs clean
        wb.reset()
        again, _ = run(eng, PROMPTS)
        assert again == clean and loud(wb, "error") == []


@pytest.mark.parametrize("bug, copy", [("kv lengths from the query lengths", "actual_seq_lengths_kv"),
                                       ("decode lengths one too long", "plan.decode.lens")])
def test_the_packing_probe_checks_the_npu_plan(sharp_llama_dir, one_thread, monkeypatch, bug, copy):
    real = NpuPagedAttention.plan

    def plan(self, batch, *a):
        p = real(self, batch, *a)
        if copy == "actual_seq_lengths_kv":
            p.actual_seq_lengths_kv = batch.query_lens_np.tolist()
        elif p.context_lens is not None:
            p.context_lens = p.context_lens + 1                          # what the decode op is handed
        return p
    monkeypatch.setattr(NpuPagedAttention, "plan", plan)
    eng = tiny_npu(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach("packing")
    [rid] = run(eng, PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))[1]
    found = wb.findings_at_least("error")
    assert found and {f.evidence["copy"] for f in found} == {copy} and found[0].request_id == rid


# ---- the probes read what the ops are handed (the plan), not the bound buffers alone ---------------
CHUNKED = {"max_num_batched_tokens": 16}        # chunked prefill beside decodes: mixed steps, each call its rows


def mixed(p) -> bool:
    return p.prefill_seq_lengths is not None and p.decode_tok is not None


@pytest.mark.parametrize("bug", ["prefill kv lengths one short", "batch ends one long"])
def test_the_cu_seqlens_probe_reads_the_lengths_the_fused_op_gets(sharp_llama_dir, one_thread, monkeypatch, bug):
    clean, ids = run(tiny_npu(sharp_llama_dir, **CHUNKED), PROMPTS)
    real, hit = NpuPagedAttention.plan, []

    def plan(self, batch, *a):
        p = real(self, batch, *a)
        if not hit and bug.startswith("prefill") and mixed(p):
            p.prefill_seq_lengths_kv = [p.prefill_seq_lengths_kv[0] - 1] + p.prefill_seq_lengths_kv[1:]
            hit.append((int(p.prefill_rows[0]), "prefill actual_seq_lengths_kv"))
        elif not hit and bug.startswith("batch") and p.prefill_seq_lengths is p.actual_seq_lengths and len(p.cu) > 2:
            p.actual_seq_lengths[0] += 1                # the same list the prefill call gets: its first span grows
            hit.append((0, "actual_seq_lengths"))
        return p
    monkeypatch.setattr(NpuPagedAttention, "plan", plan)
    eng = tiny_npu(sharp_llama_dir, **CHUNKED)
    wb = Workbench(eng, log=False).attach("cu_seqlens")
    seen = []
    eng.bus.subscribe(BatchPacked, seen.append)
    bad, ids = run(eng, PROMPTS)
    [(row, name)] = hit
    assert bad != clean                                                   # the op really read other spans
    found = [f for f in wb.findings_at_least("error") if f.evidence["tensor"] == name]
    first = next(e for e in seen if e.step == found[0].step)
    assert found and found[0].request_id == first.request_ids[row]


def test_the_page_table_probe_reads_the_table_each_op_gets(sharp_llama_dir, one_thread, monkeypatch):
    clean, _ = run(tiny_npu(sharp_llama_dir, **CHUNKED), PROMPTS)
    real, hit = NpuPagedAttention.plan, []

    def plan(self, batch, *a):
        p = real(self, batch, *a)
        t = p.decode_block_table
        if not hit and mixed(p) and t is not p.block_table and len(t) >= 2 and not torch.equal(t[0], t[1]):
            p.decode_block_table = t.flip(0).contiguous()             # the decode call's copy, rows swapped
            hit.append([batch.seqs[int(r)].request_id for r in p.decode_rows])
        return p
    monkeypatch.setattr(NpuPagedAttention, "plan", plan)
    eng = tiny_npu(sharp_llama_dir, **CHUNKED)
    wb = Workbench(eng, log=False).attach("page_table")
    bad, _ = run(eng, PROMPTS)
    [rids] = hit
    assert bad != clean
    found = [f for f in wb.findings_at_least("error") if f.kind == "op-table-mismatch"]
    assert found and {f.request_id for f in found} <= set(rids) and found[0].evidence["op"] == "_npu_paged_attention"
    assert not [f for f in wb.findings_at_least("error") if f.kind != "op-table-mismatch"]   # the bound table was right


def test_the_fp16_probe_judges_the_cache_dtype_written_not_the_label(sharp_llama_dir, one_thread):
    eng = tiny_npu(sharp_llama_dir, dtype="float16")
    eng.kv_dtype = torch.float32                   # a stale label: the pages are still float16
    wb = Workbench(eng, log=False).attach("fp16_overflow", fp16_overflow={"every": 1})
    with faults.inject(eng, "fp16_kv_overflow"):
        run(eng, PROMPTS)
    assert "fp16-kv-overflow" in {f.kind for f in wb.findings_at_least("error")}
