"""scripts/check_vllm_cuda.py / check_vllm_ascend.py (workbench/adapters/vllm/hwcheck.py) on this
machine's CPU vLLM: the same flow the hardware runs (vLLM's server with the platform's defaults,
the plugin on, a clean mixed burst, then one planted fault), so only the hardware is untested here.
--enforce-eager only shortens the CPU start (its torch.compile warm-up takes a minute here)."""
from __future__ import annotations

import os
import subprocess

import pytest

from workbench.adapters.vllm.model_dir import DEFAULT_DIR
from workbench.adapters.vllm.server import ROOT, vllm_python

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")


def test_the_hardware_check_script_passes_on_this_cpu_vllm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    p = subprocess.run([str(vllm_python()), "scripts/check_vllm_cuda.py", "--model", str(DEFAULT_DIR),
                        "--vllm-arg=--block-size=32", "--vllm-arg=--enforce-eager"], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=600)
    out = p.stdout
    assert p.returncode == 0 and "RESULT PASS" in out, out + p.stderr[-3000:]
    assert "vllm_pool: active via Scheduler.schedule + Scheduler.update_from_output (EngineCore.step" in out
    assert "vllm_metadata: active via AttentionMetadataBuilder.build (CPUModelRunner" in out
    assert "vllm_attention: active via AttentionImpl.forward (per layer) (30 of 30 attention layers" in out
    ran = next(ln for ln in out.splitlines() if ln.startswith("ran: "))
    assert int(ran.split("attention check ")[1].split()[0]) > 0, ran
    assert "clean run: 0 findings >= warn" in out
    verdicts = [ln for ln in out.splitlines() if ln.startswith("VERDICT ")]       # one line per check
    assert [v.split(":")[0][8:] for v in verdicts] == ["vllm_pool", "vllm_metadata", "vllm_attention",
                                                       "clean run silent", "planted fault caught"], verdicts
    assert all(": PASS (" in v for v in verdicts), verdicts
    line = next(ln for ln in out.splitlines() if ln.startswith("planted permuted_block_table_rows"))
    assert not line.startswith("planted permuted_block_table_rows: 0/") and "caught: step" in line
