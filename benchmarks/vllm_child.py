"""What the in-process vLLM benchmarks share: the tiny model, and one child run of a script in vLLM's
environment with the plugin on (a workbench listening) or off, its RESULT line read back.

Used by vllm_engine_core_cost.py and vllm_step_stalls.py (each runs itself with --child ... there).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KV_BYTES_A_TOKEN = 512          # the tiny model: 2 layers x K and V x 2 heads x 32 x bf16


def tiny_model() -> str:
    """The tiny Llama's directory, written by vLLM's environment once (tiny_model.py)."""
    from workbench.adapters.vllm.server import vllm_python
    return subprocess.run([str(vllm_python()), "-c", "from workbench.adapters.vllm.tiny_model import "
                           "write_tiny_model_dir as w; print(w())"], cwd=str(ROOT), capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def run_child(script: str, args: list[str], blocks: int, plugin: bool = True, extra_env: dict | None = None,
              timeout_s: float = 3600) -> dict | str:
    """`script --child *args` with vLLM's Python, KV space for `blocks` blocks of 32 tokens; the RESULT
    line's object, or the end of its stderr when it printed none."""
    from workbench.adapters.vllm.listener import SanitizerListener
    from workbench.adapters.vllm.server import free_port, vllm_python
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM_")}
    gib = max(1, -(-blocks * 32 * KV_BYTES_A_TOKEN // 2**30) + 1)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(gib), VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    lis = None
    if plugin:
        addr = f"tcp://127.0.0.1:{free_port()}"
        lis = SanitizerListener(addr)
        env["PAGEDKV_VLLM_SANITIZER"] = addr
        env.update(extra_env or {})
    try:
        p = subprocess.run([str(vllm_python()), script, "--child", *map(str, args)], cwd=str(ROOT), env=env,
                           capture_output=True, text=True, timeout=timeout_s)
    finally:
        if lis is not None:
            lis.close()
    from workbench.adapters.vllm.driver import result_of
    res = result_of(p.stdout)
    return res if res is not None else p.stderr[-1500:]
