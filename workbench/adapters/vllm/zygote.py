"""One vLLM process with vLLM already imported, forked once per run: runs start in ~2 s, not ~8.

Importing vLLM and building its config take ~5-6 s of the ~8 s a fresh EngineCore costs here
(the steps of a test run take 1-3 s more), and the tests and notebooks start vLLM's EngineCore
a few dozen times. This process imports what every run imports (vLLM's engine, scheduler,
executor, CPU worker and model runner, the Llama model, transformers, torch's compiler stack)
and works out what every run's first step would work out the same (inductor's vector ISA and
source hashes, ~1.6 s). Then it freezes what it holds for the garbage collector: vLLM collects
a few times while an engine starts, ~1.4 s a run over the unfrozen heap. Nothing else: no
engine, no plugin, no thread of its own, no environment read that a run could want otherwise.
A clean tiny-model run: ~7.7 s before these three, ~4.9 s with them, ~2.6 s since a test run skips
vLLM's teardown (inproc.py's --teardown) and the driver stops listening once the stream is quiet.
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
           "vllm.model_executor.models.llama", "transformers",
           # vLLM's sampler torch.compiles its logprob ranks on a run's first step: the compiler stack
           "torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codecache",
           "torch._functorch.aot_autograd")


def preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:          # noqa: BLE001 - a module this vLLM lacks: the run imports what it has
            pass
    # What that compile works out the same in every run, cached in torch's modules so that a fork
    # inherits the answers (a plain call each, no thread, no kernel run): which vector ISA inductor's
    # C++ may use (four probe processes, ~0.9 s) and the hashes of torch's and triton's sources that
    # key its caches (~0.7 s). A torch without one of them: the run works it out itself.
    for warm in (_vec_isa, _source_keys):
        try:
            warm()
        except Exception:          # noqa: BLE001
            pass


def _vec_isa() -> None:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    pick_vec_isa()


def _source_keys() -> None:
    from torch._inductor.codecache import torch_key, triton_key
    torch_key()
    triton_key()


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
    # What was imported lives as long as every run: frozen, the cyclic collector of each run skips it
    # (vLLM collects several times while an engine starts: ~1.4 s a run over vLLM, torch and
    # transformers unfrozen), and the fork's pages stay shared, not copied by the collector's writes.
    import gc
    gc.collect()
    gc.freeze()
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
