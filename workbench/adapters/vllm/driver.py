"""Run vLLM's real EngineCore in a subprocess of the vLLM environment, the workbench listening.

For tests, benchmarks and notebooks (tests/vllm_inproc.py re-exports it).
workbench/adapters/vllm/inproc.py is the driver (vLLM's own EngineArgs, EngineCore,
scheduler, executor, CPU runner); this binds a SanitizerListener, starts it with the plugin's
settings, and returns what came back: the driver's result, the listener's state, vLLM's log.
`pre` is Python run in the subprocess before the driver (a test's planted bug).

Each run is a fork of one long-lived vLLM process that has vLLM imported already (zygote.py):
a run of its own, its environment and exit code its own, started in ~2 s rather than ~8.
PAGEDKV_VLLM_ZYGOTE=0 starts every run as a fresh `python -c` instead (and so does a zygote
that cannot start or has died).
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
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
    attention_costs: dict | None = None

    def at_least(self, sev: str) -> list:
        return [f for f in self.findings if f.at_least(sev)]


class Zygote:
    """The parent side of zygote.py: one per process, started on first use, gone at exit."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([str(vllm_python()), "-m", "workbench.adapters.vllm.zygote"], env=env,
                                     cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="vllm-zygote-reader").start()
        if self._next(120) != "READY":
            self.close()
            raise RuntimeError("the vLLM zygote did not start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)                                   # it has gone

    def _next(self, timeout_s: float):
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return "TIMEOUT"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, code: str, argv: list, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="pagedkv-vllm-run-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            job = {"code": code, "argv": list(argv), "env": env, "cwd": str(ROOT), "stdout": str(out),
                   "stderr": str(err)}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            got = self._next(60)
            if not (got or "").startswith("PID "):
                raise RuntimeError(f"the vLLM zygote did not fork a run: {got!r}")
            pid = int(got.split()[1])
            got = self._next(timeout_s)
            if got == "TIMEOUT":
                os.kill(pid, signal.SIGKILL)
                self._next(30)
                raise subprocess.TimeoutExpired(["vllm-zygote-run", *argv], timeout_s)
            if not (got or "").startswith(f"EXIT {pid} "):
                raise RuntimeError(f"the vLLM zygote lost run {pid}: {got!r}")
            return subprocess.CompletedProcess(argv, int(got.split()[2]), out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_ZYGOTE: list = []            # [Zygote] once started; [None] once it could not be


def _zygote(env: dict):
    if os.environ.get("PAGEDKV_VLLM_ZYGOTE", "1") == "0":
        return None
    if _ZYGOTE and (_ZYGOTE[0] is None or _ZYGOTE[0].alive()):
        return _ZYGOTE[0]
    _ZYGOTE.clear()
    try:
        z = Zygote(env)
        atexit.register(z.close)
    except Exception:              # noqa: BLE001 - runs start as plain processes instead
        z = None
    _ZYGOTE.append(z)
    return z


def run_python(code: str, *args: str, env: dict | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`code` run by the vLLM environment's Python as `python -c code args...` would (a fork of the
    zygote, ~1 s, where one runs; a fresh process otherwise, ~8 s): its own environment (this one's
    by default), exit code and captured text output; cwd the repository."""
    return _run(code, args, dict(os.environ) if env is None else env, timeout_s)


def _run(code: str, args: tuple, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    z = _zygote({k: v for k, v in env.items() if not k.startswith("PAGEDKV_")})
    if z is not None:
        return z.run(code, list(args), env, timeout_s)
    return subprocess.run([str(vllm_python()), "-c", code, *args], env=env, capture_output=True, text=True,
                          cwd=str(ROOT), timeout=timeout_s)


def run_inproc(*args: str, env: dict | None = None, pre: str = "", listen: bool = True,
               timeout_s: float = 300) -> Run:
    addr = f"tcp://127.0.0.1:{free_port()}"
    lis = SanitizerListener(addr, poll_ms=20) if listen else None      # closed at once when the run is done
    e = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM_")}
    e.update(PAGEDKV_VLLM_SANITIZER=addr)
    e.update(env or {})
    code = (pre + "\nimport sys\nfrom workbench.adapters.vllm.inproc import main\nmain(sys.argv[1:])\n")
    try:
        p = _run(code, args, e, timeout_s)
        if lis is not None:
            lis.settle(0.1)                              # the last messages in flight (the run has exited)
        result = result_of(p.stdout)
        if lis is None:
            return Run(p.returncode, result, p.stdout + p.stderr, [], {}, {}, [], [])
        with lis.lock:
            return Run(p.returncode, result, p.stdout + p.stderr, list(lis.findings), dict(lis.statuses),
                       dict(lis.costs), list(lis.steps), list(lis.errors),
                       dict(lis.attention_costs))
    finally:
        if lis is not None:
            lis.close()


def result_of(stdout: str) -> dict | None:
    """The driver's last RESULT object in a run's stdout, or None. Found where it starts in a line, not
    only at its start: a thread of the run (vLLM's logging, a test's sampler) may have left a line
    unfinished when the driver wrote it."""
    found = None
    for ln in stdout.splitlines():
        at = ln.find("RESULT {")
        if at >= 0:
            try:
                found, _ = json.JSONDecoder().raw_decode(ln, at + 7)
            except ValueError:                      # a line that only mentions one (a log line)
                continue
    return found


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
