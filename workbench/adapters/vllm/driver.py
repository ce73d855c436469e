"""Run vLLM's real EngineCore in a subprocess of the vLLM environment, the workbench listening.

For tests, benchmarks and notebooks (tests/vllm_inproc.py re-exports it).
workbench/adapters/vllm/inproc.py is the driver (vLLM's own EngineArgs, EngineCore,
scheduler, executor, CPU runner); this binds a SanitizerListener, starts it with the plugin's
settings, and returns what came back: the driver's result, the listener's state, vLLM's log.
`pre` is Python run in the subprocess before the driver (a test's planted bug).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .listener import SanitizerListener
from .server import ROOT, free_port, vllm_python


@dataclass
class Run:
    rc: int
    result: dict | None
    log: str
    findings: list
    statuses: dict
    costs: dict
    steps: list
    errors: list

    def at_least(self, sev: str) -> list:
        return [f for f in self.findings if f.at_least(sev)]


def run_inproc(*args: str, env: dict | None = None, pre: str = "", listen: bool = True,
               timeout_s: float = 300) -> Run:
    addr = f"tcp://127.0.0.1:{free_port()}"
    lis = SanitizerListener(addr) if listen else None
    e = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM_")}
    e.update(PAGEDKV_VLLM_SANITIZER=addr)
    e.update(env or {})
    code = (pre + "\nimport sys\nfrom workbench.adapters.vllm.inproc import main\nmain(sys.argv[1:])\n")
    try:
        p = subprocess.run([str(vllm_python()), "-c", code, *args], env=e, capture_output=True, text=True,
                           cwd=str(ROOT), timeout=timeout_s)
        time.sleep(0.3)                                  # the last messages in flight
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(res[-1][7:]) if res else None
        if lis is None:
            return Run(p.returncode, result, p.stdout + p.stderr, [], {}, {}, [], [])
        with lis.lock:
            return Run(p.returncode, result, p.stdout + p.stderr, list(lis.findings), dict(lis.statuses),
                       dict(lis.costs), list(lis.steps), list(lis.errors))
    finally:
        if lis is not None:
            lis.close()


def fault_file(tmp: Path, *names: str) -> str:
    path = tmp / "faults.json"
    path.write_text(json.dumps({"faults": list(names)}))
    return str(path)


def plugin_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "PagedKV Workbench" in ln]


if __name__ == "__main__":          # by hand: python -m workbench.adapters.vllm.driver --batch-queue
    r = run_inproc(*sys.argv[1:])
    print(r.rc, r.result and {k: r.result[k] for k in ("steps", "step_fn", "scheduler")}, r.statuses)
    for f in r.findings:
        print(f.severity, f.kind, f.request_id, f.message)
