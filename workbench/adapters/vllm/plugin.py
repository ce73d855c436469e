"""The vLLM general plugin: the workbench's checks inside a running vLLM, off unless asked for.

Registered as the `vllm.general_plugins` entry point `pagedkv_workbench`, so vLLM calls
register() in each of its processes (API server, engine core, workers). Installing the
workbench beside vLLM changes nothing until PAGEDKV_VLLM_SANITIZER names the address a
workbench listens on (Workbench.connect_vllm(sanitizer=...) binds it, on 127.0.0.1):

    PAGEDKV_VLLM_SANITIZER=tcp://127.0.0.1:5590 python -m vllm.entrypoints.openai.api_server ...

Also read: PAGEDKV_VLLM_POOL_EVERY (check the block pool every N steps, default 1) and
PAGEDKV_VLLM_FAULT_FILE (a JSON file naming vLLM faults to plant, for tests and the
fault notebooks; see faults.py).
"""
from __future__ import annotations

import os

ENV_SANITIZER = "PAGEDKV_VLLM_SANITIZER"
ENV_POOL_EVERY = "PAGEDKV_VLLM_POOL_EVERY"
ENV_FAULT_FILE = "PAGEDKV_VLLM_FAULT_FILE"


def register() -> None:
    """vLLM's entry point: install the hooks in this process when a sanitizer address is set."""
    address = os.environ.get(ENV_SANITIZER)
    if not address:
        return                                   # off by default
    from . import hooks
    hooks.install(address, pool_every=int(os.environ.get(ENV_POOL_EVERY, "1") or 1),
                  fault_file=os.environ.get(ENV_FAULT_FILE))
