"""Signals that cannot hurt vLLM: a storm of SIGUSR1 (an operator pressing "dump" again and again, a
supervisor that retries), then SIGTERM, on vLLM's real EngineCore in-process with the plugin and the
flight recorder on. Before: the handler froze a bundle inside the step, the next signal re-entered
it, and after ~250 signals the engine core died of RecursionError. Now a handler only records the
ask; the recorder's thread freezes one bundle per burst; SIGTERM's bundle is on disk before the
process exits through the handler that was there before ours.
"""
from __future__ import annotations

import json
import signal

import pytest

from workbench.adapters.vllm.server import vllm_python

from vllm_inproc import run_inproc

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")

STORM = r'''
import glob, os, signal, sys, threading, time
def storm():
    d = os.environ["PAGEDKV_RECORD_DIR"]
    t0 = time.time()
    while not glob.glob(d + "/vllm-*/seg-*") and time.time() - t0 < 240:
        time.sleep(0.01)
    from workbench.adapters.vllm import hooks
    time.sleep(0.3)
    s0, n, t1 = hooks.POOL.step, 0, time.time()
    while time.time() - t1 < 1.5:                      # ~300 signals in 1.5 s, while vLLM steps
        os.kill(os.getpid(), signal.SIGUSR1)
        n += 1
        time.sleep(0.005)
    time.sleep(1.5)
    # one write, newline included (print writes it apart: vLLM's log line could land between them)
    sys.stdout.write(f"STORM {n} {s0} {hooks.POOL.step}\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=storm, daemon=True).start()
'''


def test_a_signal_storm_then_sigterm_leaves_one_bundle_per_burst_and_exits_cleanly(vllm_models, tmp_path):
    rec = tmp_path / "rec"
    r = run_inproc("--model", vllm_models["plain"], "--requests", "48", "--max-tokens", "400", "--max-num-seqs", "16",
                   env={"PAGEDKV_RECORD_DIR": str(rec)}, pre=STORM, timeout_s=600)
    assert "RecursionError" not in r.log and "Traceback" not in r.log, r.log[-4000:]
    lines = [ln.split() for ln in r.log.splitlines() if ln.startswith("STORM ")]
    assert lines, r.log[-4000:]
    _, n, s0, s1 = lines[-1]
    assert int(n) > 150 and int(s1) > int(s0) + 10          # vLLM went on stepping through the storm
    assert r.rc == -signal.SIGTERM                           # exited on SIGTERM, through the default handler
    (root,) = list(rec.glob("vllm-*"))
    bundles = sorted(p for p in (root / "bundles").iterdir() if not p.name.startswith("."))
    reasons = [json.loads((b / "manifest.json").read_text())["reason"] for b in bundles]
    usr1 = [x for x in reasons if x == "SIGUSR1"]
    assert 1 <= len(usr1) <= 2, reasons                      # one burst: one bundle (two if it outlasts 2 s)
    assert reasons[-1] == "SIGTERM", reasons                 # frozen before the process went
    assert not list((root / "bundles").glob(".partial-*"))

