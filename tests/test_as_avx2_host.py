"""`make test-as-avx2`'s shim (tests/as_avx2_host/sitecustomize.py): in a process with that directory on
PYTHONPATH, torch's probes of the silicon say no to AVX-512 and AMX, and vLLM's CPU platform then loads
the kernel library a real AVX2-only host loads (`vllm._C_AVX2`), which runs with oneDNN held to AVX2;
without the shim every probe says what the silicon says."""
import ast
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.adapters.vllm.server import vllm_python
# this machine's own flags, read from /proc/cpuinfo (not from torch, which the shim patches; not through
# PAGEDKV_CPU_FEATURES, which make test-as-avx2 sets)
from workbench.engine.kernels.cpu import _read as _silicon

SHIM = Path(__file__).parent / "as_avx2_host"

# what torch.cpu answers: each probe the shim hides, and the features get_capabilities() reports as present
PROBES = ("import json, sys, torch\n"
          "print(json.dumps({'probes': {n: getattr(torch.cpu, n)() for n in json.loads(sys.argv[1]) if hasattr(torch.cpu, n)},\n"
          "                  'features': sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)}))")

# which of vLLM's kernel libraries its CPU platform loads, read from the process's own mappings
LOADED = ("import json\nfrom vllm.platforms import current_platform\ncurrent_platform.import_kernels()\n"
          "print(json.dumps(sorted({ln.rsplit('/', 1)[-1].strip() for ln in open('/proc/self/maps') if '/vllm/_C' in ln})))")


def _hidden() -> list[str]:
    """The names the shim hides, read from its source (importing it here would patch this process)."""
    tree = ast.parse((SHIM / "sitecustomize.py").read_text())
    return next(list(ast.literal_eval(n.value)) for n in tree.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "HIDDEN")


# what `make test-as-avx2` sets besides the shim: dropped for a run without it, which must be the host's own
CAPS = ("PYTHONPATH", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
        "PAGEDKV_CPU_FEATURES", "PAGEDKV_MARCH")


def _run(python, env_extra: dict, shim: bool, *args: str) -> object:
    env = {k: v for k, v in os.environ.items() if k not in CAPS} | env_extra
    if shim:
        env["PYTHONPATH"] = str(SHIM)
    done = subprocess.run([str(python), "-c", *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_shim_hides_avx512_and_amx_from_torch_only_where_it_is_on_the_path():
    flags = _silicon()
    names = json.dumps(_hidden())
    shimmed = _run(sys.executable, {}, True, PROBES, names)
    assert set(shimmed["probes"]) == set(_hidden()), "a name the shim hides is not one of torch.cpu's probes"
    assert not any(shimmed["probes"].values()), shimmed
    assert not [f for f in shimmed["features"] if f.startswith(("avx512", "amx"))], shimmed["features"]
    if {"avx2", "fma"} <= flags:                    # what an AVX2-only host has stays
        assert {"avx2", "fma3"} <= set(shimmed["features"]), shimmed["features"]
    plain = _run(sys.executable, {}, False, PROBES, names)
    assert plain["probes"]["_is_avx512_supported"] == ("avx512f" in flags)
    assert plain["probes"]["_is_avx512_bf16_supported"] == ("avx512_bf16" in flags)
    assert ("avx512_f" in plain["features"]) == ("avx512f" in flags)


@pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="vLLM's AVX2 / AVX-512 kernel libraries are x86's")
def test_vllm_loads_its_avx2_kernels_under_the_shim():
    capped = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert _run(vllm_python(), capped, True, LOADED) == ["_C_AVX2.abi3.so"]
    if "avx512f" in _silicon():                     # an AVX-512 host: without the shim vLLM loads another library
        native = _run(vllm_python(), {}, False, LOADED)
        assert native and native != ["_C_AVX2.abi3.so"], native
