"""The kernels package (workbench/engine/kernels/): one loader, a cache keyed by the CPU features a
build was compiled for, a refusal (not a SIGILL) on a CPU that lacks one, and the KernelSelection
an engine reports (engine.kernels, kvwb doctor)."""
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from workbench import Engine, EngineConfig
from workbench.engine import kernels, pool_ops
from workbench.engine.attention import CpuPagedAttention, TorchPagedAttention, native
from workbench.engine.kernels import cache, cpu_features
from workbench.engine.kernels.loader import Kernel
from workbench.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [[1, 17, 99, 3, 45, 200, 8], [1, 5, 5, 130, 77], [1, 250, 4, 4, 4, 61, 12, 90, 33]]
AVX512 = "avx512f"

# One engine in a fresh process (the loader decides once per process): its tokens, its
# KernelSelection and each extension's reason for being unavailable, as JSON on stdout.
ENGINE_RUN = """
import json, sys
from workbench import Engine, EngineConfig
from workbench.engine import kernels
from workbench.engine.sequence import SamplingParams
eng = Engine.from_pretrained(sys.argv[1], EngineConfig(num_pages=128, enable_prefix_caching=False))
outs = eng.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=12, temperature=0.0))
print(json.dumps({"tokens": [o.token_ids for o in outs], "kernels": eng.kernels.as_dict(),
                  "attn": type(eng.attn).__name__, "pool": eng.pool._ops.name,
                  "why": {n: k.why() for n, k in kernels.ALL.items()},
                  "entry": {n: str(k.entry()) for n, k in kernels.ALL.items()}}))
"""


def _engine_run(model_dir, env: dict) -> tuple[dict, str]:
    full = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(model_dir), json.dumps(PROMPTS)], env=full,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def built():
    """This process's real cache entries (built by `make`, or now): every extension loaded."""
    missing = {n: k.why() for n, k in kernels.ALL.items() if k.get() is None}
    if missing and os.environ.get("PAGEDKV_CPU_FEATURES"):
        pytest.skip(f"the faked CPU (PAGEDKV_CPU_FEATURES) refuses this host's builds: {missing}")
    if missing:
        if shutil.which("c++") is None and shutil.which("cc") is None:
            pytest.skip(f"no compiler: {missing}")
        pytest.fail(f"extensions did not load: {missing}")
    return {n: k.entry() for n, k in kernels.ALL.items()}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, built):
    """Greedy tokens of the tiny Llama on the compiled path, in this process."""
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, enable_prefix_caching=False))
    return eng, [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]


def _copy_cache(built: dict, dest):
    """The entries copied into a fresh cache dir, every manifest listing avx512f: as if built on an
    AVX-512 host (the C++ kernels' are, where this CPU has it; the portable C loops' are not)."""
    for name, entry in built.items():
        shutil.copytree(entry, dest / entry.name, ignore=shutil.ignore_patterns("lock"))
        m = cache.read_manifest(dest / entry.name)
        fields = {k: v for k, v in m.items() if k not in ("cpu_features", "key")}
        cache.write_manifest(dest / entry.name, fields, set(m["cpu_features"]) | {AVX512})


def _without_avx512() -> str:
    return ",".join(sorted(f for f in cpu_features() if not f.startswith("avx512")) or ["sse2"])


# --- (a) a copied AVX-512 cache on a CPU without AVX-512 ------------------------------------------------


def test_a_copied_avx512_cache_is_refused_on_a_cpu_without_it_and_the_python_path_runs(tmp_path, tiny_llama_dir,
                                                                                       built, reference):
    fresh = tmp_path / "cache"
    _copy_cache(built, fresh)
    files = {p: p.stat().st_mtime_ns for p in fresh.rglob("*")}
    got, stderr = _engine_run(tiny_llama_dir, {"PAGEDKV_EXTENSIONS_DIR": str(fresh),
                                               "PAGEDKV_CPU_FEATURES": _without_avx512()})
    for name, entry in built.items():
        why = got["why"][name]
        # refused, with the missing feature, the entry it came from, and what runs instead
        assert why and "refused" in why and AVX512 in why and str(fresh / entry.name) in why, why
        assert "SIGILL" in why and "Python / torch path" in why, why
        assert why in stderr                                      # logged as a warning too
        assert got["entry"][name] == str(fresh / entry.name)
    assert {p: p.stat().st_mtime_ns for p in fresh.rglob("*")} == files      # refused: nothing rebuilt over it
    ks = got["kernels"]
    assert got["attn"] == "TorchPagedAttention" and ks["attention"] == "torch" and AVX512 in ks["attention_why"]
    assert not ks["linear"].startswith("skinny") and AVX512 in ks["linear_why"]
    assert got["pool"] == ks["pool_ops"] == "python" and AVX512 in ks["pool_ops_why"]
    _, tokens = reference
    assert got["tokens"] == tokens                                # the same text on the Python / torch path


def test_the_copied_cache_loads_where_the_cpu_has_the_features(tmp_path, tiny_llama_dir, built, reference):
    """The same copy on a CPU with AVX-512 (this one, or one faked with it): found by its key, loaded, not rebuilt."""
    fresh = tmp_path / "cache"
    _copy_cache(built, fresh)
    have = ",".join(sorted(cpu_features() | {AVX512}))
    got, _ = _engine_run(tiny_llama_dir, {"PAGEDKV_EXTENSIONS_DIR": str(fresh), "PAGEDKV_CPU_FEATURES": have})
    assert got["why"] == {n: None for n in built}
    assert got["entry"] == {n: str(fresh / e.name) for n, e in built.items()}
    assert got["kernels"]["attention"].startswith("cpu") and got["kernels"]["pool_ops"] == "compiled"
    assert got["tokens"] == reference[1]


def test_refusal_in_process_warns_and_does_not_build(tmp_path, monkeypatch, caplog, built):
    """A fresh Kernel over the page-pool loops' spec: built into an empty cache, then its manifest
    claims avx512f and a CPU without it refuses the entry (no rebuild, the loops stay Python)."""
    monkeypatch.setenv("PAGEDKV_EXTENSIONS_DIR", str(tmp_path))
    spec = kernels.POOL_OPS.spec
    first = Kernel(spec, "the Python loops")
    assert first.get() is not None and first.entry().parent == tmp_path
    m = cache.read_manifest(first.entry())
    assert m["cpu_features"] == [] and m["torch"] and m["compiler"]          # portable C: built for no feature
    cache.write_manifest(first.entry(), {k: v for k, v in m.items() if k not in ("cpu_features", "key")},
                         ["avx512f", "avx512bw"])
    monkeypatch.setenv("PAGEDKV_CPU_FEATURES", "sse2 avx2")
    again = Kernel(spec, "the Python loops")
    with caplog.at_level(logging.WARNING, logger="workbench.engine.kernels"):
        assert again.get() is None
    assert "avx512bw, avx512f" in again.why() and str(first.entry()) in again.why()
    assert any("avx512bw, avx512f" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.entry().name]      # nothing built beside it


def test_a_manifest_of_another_torch_under_this_entrys_name_is_refused(tmp_path, monkeypatch, built):
    monkeypatch.setenv("PAGEDKV_EXTENSIONS_DIR", str(tmp_path))
    spec = kernels.POOL_OPS.spec
    entry = Kernel(spec).entry()
    m = cache.read_manifest(entry)
    cache.write_manifest(entry, {**{k: v for k, v in m.items() if k not in ("cpu_features", "key")},
                                 "torch": "0.0.1"}, [])
    k = Kernel(spec)
    assert k.get() is None and "refused" in k.why() and "torch" in k.why()


def test_without_a_compiler_a_prebuilt_entry_is_used_when_it_fits(tmp_path, monkeypatch, built):
    monkeypatch.setenv("PAGEDKV_EXTENSIONS_DIR", str(tmp_path))
    spec = kernels.POOL_OPS.spec
    entry = Kernel(spec).entry()                                     # built with this machine's cc
    monkeypatch.setenv("CC", "false")                               # and now there is none
    k = Kernel(spec)
    assert k.get() is not None and k.entry() == entry
    monkeypatch.setenv("PAGEDKV_CPU_FEATURES", "sse2")
    m = cache.read_manifest(entry)
    cache.write_manifest(entry, {k: v for k, v in m.items() if k not in ("cpu_features", "key")}, ["avx512f"])
    k = Kernel(spec)
    assert k.get() is None and "avx512f" in k.why()


# --- (b) the key ---------------------------------------------------------------------------------------


def test_cache_key_changes_with_the_cpu_features_torch_compiler_and_sources(tmp_path):
    spec = kernels.ATTENTION.spec
    f = cache.key_fields(spec, "c++ 12.2.0", torch="2.13.0+cpu")
    base = cache.cache_key(f, {"avx2", "fma"})
    assert cache.cache_key(f, {"fma", "avx2"}) == base                     # a set: order does not matter
    assert cache.cache_key(f, {"avx2", "fma", "avx512f"}) != base
    assert cache.cache_key(cache.key_fields(spec, "c++ 12.2.0", torch="2.14.0+cpu"), {"avx2", "fma"}) != base
    assert cache.cache_key(cache.key_fields(spec, "c++ 13.1.0", torch="2.13.0+cpu"), {"avx2", "fma"}) != base
    # the directory is named by what is built, not by the CPU: a copied cache is found, then checked
    assert cache.entry_dir(spec, f) != cache.entry_dir(spec, cache.key_fields(spec, "c++ 12.2.0", torch="2.14.0"))
    src = tmp_path / "x.c"
    src.write_text("int x;")
    s = kernels.Spec("x", (src,), "x", kind="c", headers=())
    before = cache.key_fields(s, "cc")
    src.write_text("int y;")
    assert cache.key_fields(s, "cc") != before
    # the headers are hashed too (torch's ninja tracks sources only)
    hdr = tmp_path / "h.h"
    hdr.write_text("#define A 1")
    s2 = dataclasses.replace(s, headers=(hdr,))
    before = cache.key_fields(s2, "cc")
    hdr.write_text("#define A 2")
    assert cache.key_fields(s2, "cc") != before


def test_cpu_features_override_and_the_native_builds_list_this_cpu(monkeypatch, built):
    assert cpu_features("avx2, fma avx512f") == {"avx2", "fma", "avx512f"}
    monkeypatch.setenv("PAGEDKV_CPU_FEATURES", "sse2")
    assert cpu_features() == {"sse2"}
    monkeypatch.delenv("PAGEDKV_CPU_FEATURES")
    real = cpu_features()
    assert not any(f.startswith(("bug", "vmx", "hypervisor")) for f in real)   # ISA flags only
    m = cache.read_manifest(built["attention"])
    march = os.environ.get("PAGEDKV_MARCH") or "native"                         # make test-cpus: x86-64-v3
    assert set(m["cpu_features"]) <= real and f"-march={march}" in m["flags"]   # compiled for this CPU
    assert cache.read_manifest(built["pool_ops"])["cpu_features"] == []          # portable


# --- (c) kvwb doctor -------------------------------------------------------------------------------------


def test_doctor_prints_the_kernel_selection(capsys, monkeypatch, built):
    from workbench import cli
    from workbench.engine import peaks
    from workbench.engine import kernel_selection as selection
    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", lambda *a, **k: 10.0)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", lambda *a, **k: 20.0)
    assert cli.main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    sel = selection.probe(device="cpu")
    assert "KernelSelection:" in out and sel.short() in out
    for key, value in sel.rows():
        assert f"kernel {key}:" in out and value in out, (key, out)
    assert cli.main(["doctor", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernel_selection"] == sel.as_dict()
    assert report["attention_backend"] == sel.attention.split()[0]


# --- (d) engine.kernels says what runs -------------------------------------------------------------------


def test_engine_kernels_read_back_what_runs(reference, tiny_llama_dir):
    eng, tokens = reference
    ks = eng.kernels
    with pytest.raises(dataclasses.FrozenInstanceError):
        ks.attention = "torch"
    assert isinstance(eng.attn, CpuPagedAttention) and eng.attn.kernel is native.kernel()
    assert ks.attention.startswith("cpu (compiled") and str(kernels.ATTENTION.entry()) in ks.attention_why
    from workbench.engine import skinny_gemm
    assert ks.linear == eng.model.linear_backend
    assert ks.linear.startswith("skinny") == (skinny_gemm.for_linears() is not None), ks.linear
    assert ks.pool_ops == eng.pool._ops.name == pool_ops.active().name == "compiled"
    assert ks.bf16 == "off"
    # the config's switch: torch attention, and the selection says so
    t = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, enable_prefix_caching=False,
                                                            attention_backend="torch"))
    assert type(t.attn) is TorchPagedAttention and t.kernels.attention == "torch"
    assert "attention_backend='torch'" in t.kernels.attention_why
    assert [o.token_ids for o in t.generate(PROMPTS, GREEDY)] == tokens
    # a bf16 engine: the mode it computes in, read from the model
    b = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=128, dtype="bfloat16"))
    assert b.kernels.bf16 == ("native" if b.model.dtype.is_floating_point and b.model.dtype.itemsize == 2
                              else "storage")


def test_the_environment_switch_is_what_the_selection_reports(tiny_llama_dir, reference):
    got, _ = _engine_run(tiny_llama_dir, {"PAGEDKV_ATTENTION": "torch", "PAGEDKV_POOL": "python"})
    ks = got["kernels"]
    assert got["attn"] == "TorchPagedAttention" and ks["attention"] == "torch"
    assert "PAGEDKV_ATTENTION=torch" in ks["attention_why"]
    assert got["pool"] == ks["pool_ops"] == "python" and "PAGEDKV_POOL=python" in ks["pool_ops_why"]
    assert got["tokens"] == reference[1]
