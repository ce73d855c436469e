"""One vLLM process with vLLM already imported, forked once per run: runs start in ~2 s, not ~8.

Importing vLLM and building its config take ~5-6 s of the ~8 s a fresh EngineCore costs here
(the steps of a test run take 1-3 s more), and the tests and notebooks start vLLM's EngineCore
a few dozen times. This process imports what every run imports (vLLM's engine, scheduler,
executor, CPU worker and model runner, the Llama model, transformers) and nothing else: no
engine, no plugin, no thread of its own, no environment read that a run could want otherwise.
Each run is a fork of it, so a run is still a process of its own, with its own environment, its
plugin loaded by vLLM as in a server, and its own exit code; what one run does (a planted bug,
a patched module) cannot reach the next.

Protocol, one JSON object a line on stdin:
    {"code": ..., "argv": [...], "env": {...}, "cwd": ..., "stdout": PATH, "stderr": PATH}
answered by "PID <pid>" once the run is forked and "EXIT <pid> <rc>" when it ends (rc < 0: the
signal that killed it). The caller kills a run that overstays with the pid it was told.

    .venv-vllm/bin/python -m workbench.adapters.vllm.zygote     # by workbench/adapters/vllm/driver.py
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback

PRELOAD = ("vllm", "vllm.engine.arg_utils", "vllm.v1.engine.core", "vllm.v1.executor.abstract",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler",
           "vllm.model_executor.models.llama", "transformers")


def preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:          # noqa: BLE001 - a module this vLLM lacks: the run imports what it has
            pass


def child(job: dict) -> None:
    """The forked run: its own environment, files for its output, the code as `python -c` runs it."""
    rc = 0
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)      # a run is interrupted as python -c is
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = open(0, closefd=False)
        sys.argv = ["-c", *job["argv"]]
        exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:          # noqa: BLE001 - printed as python would, and the exit code says so
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def main() -> None:
    # a Ctrl-C or a Jupyter kernel's interrupt reaches the whole process group: it is for the run,
    # not for this process, which goes when its caller closes stdin or kills it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preload()
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(job)
        out.write(f"PID {pid}\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}\n")
        out.flush()


if __name__ == "__main__":
    main()
