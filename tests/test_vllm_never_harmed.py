"""A real vLLM server with every bad setting the issue tried at once: it starts, it serves, and its
log names each cause in one line (issue 26, item 3).

Before: PAGEDKV_VLLM_POOL_EVERY=often stopped vLLM from starting (a ValueError in register), a
fault file holding {"faults": null} killed the engine core on the first request (HTTP 500 for
every request after), and PAGEDKV_VLLM_SANITIZER=not-an-address served with nothing in the log.
The other causes (an exception inside a check, a check that stops running) are in
test_vllm_step_paths.py; the parsing of each setting in test_vllm_plugin_units.py.
"""
from __future__ import annotations

import pytest

from workbench.adapters.vllm.server import VllmServer, vllm_python

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")


def test_bad_settings_leave_vllm_serving_and_each_is_one_log_line(tmp_path):
    faults = tmp_path / "faults.json"
    faults.write_text('{"faults": null}')
    server = VllmServer(sanitizer="not-an-address", fault_file=str(faults), log_path=tmp_path / "vllm.log",
                        extra_env={"PAGEDKV_VLLM_POOL_EVERY": "often"})
    with server:
        answers = [server.chat([{"role": "user", "content": q}], max_tokens=12)
                   for q in ("What is a page table?", "What is a KV cache?")]
        log = server.log_path.read_text(errors="replace")
    for a in answers:                                      # served: HTTP 200 with a completion each time
        assert a["choices"][0]["message"]["content"] and a["usage"]["completion_tokens"] > 0
    ours = [ln for ln in log.splitlines() if "PagedKV Workbench" in ln]
    # vLLM starts the plugin in each of its processes: each cause is said once per process, one line each
    assert any("PAGEDKV_VLLM_POOL_EVERY='often' is not a whole number >= 1; using 1" in ln for ln in ours), ours
    assert any(str(faults) in ln and '"faults" must be a list of names' in ln for ln in ours), ours
    assert any("PAGEDKV_VLLM_SANITIZER='not-an-address' is not an address" in ln for ln in ours), ours
    # and the checks still say what they run on
    assert any("vllm_pool: active via Scheduler.schedule + Scheduler.update_from_output" in ln for ln in ours), ours
    assert any("vllm_metadata: active via AttentionMetadataBuilder.build" in ln for ln in ours), ours
    assert "Traceback" not in log and "EngineDeadError" not in log
