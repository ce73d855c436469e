"""Every kernel path decided by trying it (engine/kernels/trials.py): a CPU without a feature, a faked
smaller CPU, a CPU of another architecture, and a path that gives a wrong result all get the
fallback, say why, and the engine's text is the one the fallback computes.

The AVX2-only case is real, not only faked: ONEDNN_MAX_CPU_ISA=AVX2 makes this host's oneDNN behave
as on an AMD EPYC without AVX-512 (its bf16 inner product cannot be created), so the trial must catch
oneDNN's own refusal, with PAGEDKV_CPU_FEATURES left alone."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from workbench.engine import pool_ops, seq_ops
from workbench.engine.kernels import SKINNY_GEMM, trials
from workbench.engine.kernels.loader import Kernel

PROMPTS = [[1, 17, 99, 3, 45, 200, 8], [1, 5, 5, 130, 77], list(range(3, 200))]     # 197 rows: above every skinny size

# One engine in a fresh process (the trials run once per process): bf16 weights, computed natively
# where asked (PAGEDKV_BF16), a prefill larger than the skinny GEMM's rows so oneDNN's path is taken.
RUN = """
import json, sys, torch
from workbench import Engine, EngineConfig, SamplingParams
from workbench.engine.kernels import trials
raw = None
try:                                   # what oneDNN itself does on this CPU, outside our code
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    torch.ops.mkldnn._linear_pointwise(torch.randn(4, 16, dtype=torch.bfloat16), w, None, "none", [], "")
except RuntimeError as e:
    raw = str(e)
eng = Engine.from_pretrained(sys.argv[1], EngineConfig(num_pages=128, enable_prefix_caching=False, dtype=sys.argv[3]))
outs = eng.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, temperature=0.0))
print(json.dumps({"tokens": [o.token_ids for o in outs], "kernels": eng.kernels.as_dict(), "raw": raw,
                  "compute": str(eng.model.dtype), "attn": type(eng.attn).__name__, "pool": eng.pool._ops.name,
                  "refused": [r.split(":")[0] for r in eng.kernels.refused]}))
"""


# These runs set their CPU themselves (the environment's PAGEDKV_* / ONEDNN_* cleared): under `make test-cpus`
# they would repeat the main run's work exactly, so they run there only.
subprocess_run = pytest.mark.skipif(bool(os.environ.get("PAGEDKV_CPU_FEATURES")),
                                    reason="sets its own CPU: the main run covers it")


def _run(model_dir, env: dict, dtype="float32") -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_", "ONEDNN_"))}
    done = subprocess.run([sys.executable, "-c", RUN, str(model_dir), json.dumps(PROMPTS), dtype],
                          env={**full, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The tiny Llama's greedy tokens with every path this host has (float32)."""
    return _run(tiny_llama_dir, {})


@subprocess_run
def test_onednn_without_bf16_is_refused_by_its_trial_and_native_bf16_runs_on_f_linear(tiny_llama_dir):
    got = _run(tiny_llama_dir, {"ONEDNN_MAX_CPU_ISA": "AVX2", "PAGEDKV_BF16": "native"}, dtype="bfloat16")
    assert got["raw"] and "primitive descriptor" in got["raw"]          # oneDNN really has no bf16 ip here
    refused = [r for r in got["kernels"]["refused"] if r.startswith("oneDNN linear (bfloat16)")]
    assert refused and "primitive descriptor" in refused[0] and "F.linear" in refused[0], got["kernels"]["refused"]
    assert got["compute"] == "torch.bfloat16"                            # native, as asked, without oneDNN's bf16
    assert "onednn" not in got["kernels"]["linear"], got["kernels"]["linear"]
    assert all(len(t) == 6 for t in got["tokens"])                       # the 197-row prefill ran (it crashed)


@subprocess_run
def test_auto_bf16_falls_back_to_storage_when_onednn_refuses(tiny_llama_dir):
    """The flags say avx512_bf16 (this host), oneDNN says no: auto takes float32 compute over bf16 storage."""
    got = _run(tiny_llama_dir, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, dtype="bfloat16")
    assert got["compute"] == "torch.float32" and got["kernels"]["bf16"] == "storage"
    assert "oneDNN's bf16 linear" in got["kernels"]["bf16_why"] or "neither" in got["kernels"]["bf16_why"]


@subprocess_run
def test_a_faked_avx2_cpu_takes_the_torch_paths_and_says_what_it_refused(tiny_llama_dir, reference):
    got = _run(tiny_llama_dir, {"PAGEDKV_CPU_FEATURES": "avx2,fma", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    ks = got["kernels"]
    assert "faked" in ks["cpu"] and "avx2 fma" in ks["cpu"]
    lines = "\n".join(ks["refused"])
    assert "oneDNN linear (bfloat16)" in lines and "instead: torch's F.linear in bfloat16" in lines
    if reference["attn"] == "CpuPagedAttention" and "avx512f" in reference["kernels"]["cpu"]:
        # this host's builds are AVX-512 ones: the faked CPU refuses them, naming the feature
        assert got["attn"] == "TorchPagedAttention" and "avx512f" in ks["attention_why"]
        assert "compiled CPU attention" in lines and "instead: the torch attention" in lines
    assert "oneDNN linear (float32)" in ks["confirmed"]
    assert got["tokens"] == reference["tokens"]                          # the same text on the fallbacks
    bf16 = _run(tiny_llama_dir, {"PAGEDKV_CPU_FEATURES": "avx2,fma"}, dtype="bfloat16")
    assert bf16["compute"] == "torch.float32" and "neither avx512_bf16 nor AMX" in bf16["kernels"]["bf16_why"]


@subprocess_run
def test_a_faked_cpu_with_no_features_runs_no_compiled_code(tiny_llama_dir, reference):
    got = _run(tiny_llama_dir, {"PAGEDKV_CPU_FEATURES": "none"})
    ks = got["kernels"]
    assert got["attn"] == "TorchPagedAttention" and got["pool"] == "python" and ks["linear"] == "torch"
    for path in ("compiled CPU attention", "compiled skinny GEMM", "compiled page-pool loops",
                 "compiled sequence loops", "oneDNN linear (float32)"):
        assert path in got["refused"], (path, got["refused"])
    assert not ks["confirmed"] or all("compiled" not in c and "oneDNN" not in c for c in ks["confirmed"])
    assert got["tokens"] == reference["tokens"]


@subprocess_run
def test_aarch64_never_loads_an_x86_build(tiny_llama_dir, reference):
    got = _run(tiny_llama_dir, {"PAGEDKV_MACHINE": "aarch64"})
    ks = got["kernels"]
    assert ks["cpu"].startswith("aarch64")
    lines = "\n".join(ks["refused"])
    assert "compiled CPU attention: refused: compiled CPU attention is written for x86_64" in lines, lines
    assert "compiled skinny GEMM: refused" in lines and "this machine is aarch64" in lines
    # the portable C loops were built here, for x86_64: refused by their manifest's machine
    assert "compiled page-pool loops: refused the cached build" in lines and "compiled for x86_64" in lines
    assert got["attn"] == "TorchPagedAttention" and got["pool"] == "python"
    assert got["tokens"] == reference["tokens"]


@subprocess_run
def test_doctor_lists_what_a_faked_avx2_cpu_refused_and_what_runs_instead():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_", "ONEDNN_"))}
    env.update(PAGEDKV_CPU_FEATURES="avx2,fma", ONEDNN_MAX_CPU_ISA="AVX2")
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "doctor"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    refused = [ln for ln in out.splitlines() if "kernel refused:" in ln]
    assert any("oneDNN linear (bfloat16)" in ln and "instead: torch's F.linear in bfloat16" in ln for ln in refused), out
    assert "faked: PAGEDKV_CPU_FEATURES='avx2,fma'" in out and "kernel confirmed:" in out


# --- a path that runs but computes the wrong thing ----------------------------------------------------


class _Skewed:
    """The real skinny GEMM module with one bug planted in gemm: the last output column dropped."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def gemm(self, *a):
        y = self._mod.gemm(*a)
        y[:, -1] = 0
        return y


@pytest.fixture()
def fresh_trials():
    saved = dict(trials._done)
    trials.forget()
    yield
    trials.forget()
    trials._done.update(saved)


def test_a_skinny_gemm_that_computes_wrong_is_refused_by_the_loader(monkeypatch):
    real = SKINNY_GEMM.get()
    if real is None:
        pytest.skip(f"no skinny GEMM here: {SKINNY_GEMM.why()}")
    x, w = torch.randn(3, 40), torch.randn(33, 40)
    good = real.gemm(x, real.pack(w), 33, None, 0, None, 0)
    bad = _Skewed(real).gemm(x, real.pack(w), 33, None, 0, None, 0)
    assert not torch.equal(good, bad)                                   # the planted bug changes the output
    monkeypatch.setattr("workbench.engine.kernels.loader.load", lambda spec: (_Skewed(real), SKINNY_GEMM.entry()))
    k = Kernel(SKINNY_GEMM.spec, "oneDNN / F.linear", trial=trials.skinny_gemm)
    assert k.get() is None
    assert "wrong result" in k.why() and "gemm (silu epilogue)" in k.why() and str(SKINNY_GEMM.entry()) in k.why()
    t = k.trial()
    assert not t.ok and t.path == "compiled skinny GEMM" and t.fallback == "oneDNN / F.linear"
    assert SKINNY_GEMM.trial().ok                                      # the process's own module is untouched


def test_the_compiled_pool_and_sequence_loops_are_tried_against_the_python_ones():
    ops = pool_ops.compiled()
    if ops is None:
        pytest.skip(f"no compiled pool loops: {pool_ops.unavailable_reason()}")
    pool_ops.trial(ops)                                                  # the real ones agree
    seq_ops.trial(seq_ops.compiled())

    def take(*a):                                                        # hands out one page too few
        pages, gens, evicted, head = ops.take(*a)
        return pages[:-1], gens[:-1], evicted, head
    with pytest.raises(trials.Mismatch, match="page-pool loops, result 0"):
        pool_ops.trial(SimpleNamespace(**{**vars(ops), "take": take}))

    def token_counts(scheduled):
        t, p = seq_ops.compiled().token_counts(scheduled)
        return t, p + 1
    with pytest.raises(trials.Mismatch, match="sequence loops, result 3"):
        seq_ops.trial(SimpleNamespace(**{**vars(seq_ops.compiled()), "token_counts": token_counts}))


def test_a_trial_gated_by_a_faked_cpu_names_the_feature(fresh_trials, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CPU_FEATURES", "sse4_2 avx avx2 fma")
    bf16 = trials.onednn_linear(torch.bfloat16)
    assert not bf16.ok and "'sse4_2 avx avx2 fma'" in bf16.why and "avx512bw" in bf16.why
    assert trials.onednn_linear(torch.float32).ok
    assert trials.onednn_linear(torch.bfloat16) is bf16                  # tried once per process


# --- PAGEDKV_MARCH: the kernels compiled for another target (an AVX2 host's, on any x86-64 host) -------


def test_a_march_target_builds_for_what_the_compiler_says_that_target_has():
    import shutil

    from workbench.engine.kernels import ATTENTION, cache
    from workbench.engine.kernels.cpu import is_x86, target_features
    cc = tuple(cache.compiler_command("torch"))
    if not is_x86() or shutil.which(cc[0]) is None:
        pytest.skip("an x86 C++ compiler is needed")
    v3 = target_features("x86-64-v3", cc)
    assert {"avx", "avx2", "fma", "f16c", "bmi2"} <= v3 and not any(f.startswith("avx512") for f in v3)
    spec = ATTENTION.spec.targeting("x86-64-v3")
    assert "-march=x86-64-v3" in spec.flags and "-march=native" not in spec.flags
    assert spec.march == "x86-64-v3" and not spec.for_this_cpu
    # its own cache entry: a native build is never loaded in its place, nor the other way round
    assert cache.entry_dir(spec, cache.key_fields(spec, "c++")) != cache.entry_dir(
        ATTENTION.spec, cache.key_fields(ATTENTION.spec, "c++"))
    assert ATTENTION.spec.targeting("native") is ATTENTION.spec and ATTENTION.spec.targeting(None) is ATTENTION.spec
    with pytest.raises(RuntimeError, match="no-such-cpu"):
        target_features("no-such-cpu", cc)


def _real_avx2_only_host() -> bool:
    """This machine's own flags (not the code under test's reading of them): avx2 and no avx512f."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "avx512f" not in flags and not os.environ.get("PAGEDKV_CPU_FEATURES")


def _faked_avx2_only_host() -> bool:
    """`make test-cpus`' faked AVX2-only host: kernels built for a named -march and a faked CPU with avx2 and
    no avx512f. PAGEDKV_MARCH alone is not enough: left in the environment, it would reach the featureless
    pass too, whose CPU loads no build at all."""
    faked = os.environ.get("PAGEDKV_CPU_FEATURES", "").lower().replace(",", " ").split()
    return bool(os.environ.get("PAGEDKV_MARCH")) and "avx2" in faked and "avx512f" not in faked


@pytest.mark.skipif(not (_faked_avx2_only_host() or _real_avx2_only_host()),
                    reason="only on an AVX2-only host: `make test-cpus`' faked one, or a real one (which skips that fake)")
def test_on_an_avx2_only_host_the_kernels_are_avx2_builds_and_bf16_takes_what_it_has():
    from workbench.engine.kernels import ATTENTION, SKINNY_GEMM, cache
    march = os.environ.get("PAGEDKV_MARCH") or "native"
    for k in (ATTENTION, SKINNY_GEMM):
        assert k.get() is not None, k.why()
        m = cache.read_manifest(k.entry())
        assert f"-march={march}" in m["flags"]
        assert "avx2" in m["cpu_features"] and not any(f.startswith(("avx512", "amx")) for f in m["cpu_features"])
    assert not trials.onednn_linear(torch.bfloat16).ok and trials.onednn_linear(torch.float32).ok
    from workbench.engine import cpu_bf16, skinny_gemm
    assert cpu_bf16.mode() == "storage" and not skinny_gemm.bf16_pairs()
