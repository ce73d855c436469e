"""Capture: what arrives is written as it arrives, reads back exactly, and survives SIGKILL."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from workbench import Engine, EngineConfig, SamplingParams
from workbench.trace import read_trace


def test_capture_round_trips_exactly(tiny_llama_dir, tmp_path):
    path = tmp_path / "cap.jsonl"
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, capture_trace=str(path)))
    sent = {}

    def submit(k):
        for j in range(5):
            ids = [3 + k, 4 + j] * (j + 1)
            p = SamplingParams(max_tokens=3 + j, temperature=0.5 * (k % 2), top_k=k, seed=j)
            sent[eng.add_request(ids, p)] = (ids, p)

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    while eng.has_unfinished():
        eng.step()
    t = read_trace(path)
    assert len(t) == 15 == eng.capture.count
    for r in t:
        ids, p = sent[r.id]
        assert r.prompt_token_ids == ids and r.output_len == p.max_tokens
        assert r.sampling["temperature"] == p.temperature and r.sampling["top_k"] == p.top_k
        assert r.sampling["seed"] == p.seed
    assert all(t[i].arrival_s <= t[i + 1].arrival_s for i in range(len(t) - 1))


def test_capture_survives_sigkill(tiny_llama_dir, tmp_path):
    path = tmp_path / "killed.jsonl"
    script = textwrap.dedent(f"""
        import sys
        from workbench import Engine, EngineConfig, SamplingParams
        eng = Engine.from_pretrained({str(tiny_llama_dir)!r}, EngineConfig(num_pages=256, capture_trace={str(path)!r}))
        i = 0
        while True:
            eng.add_request([5 + i % 200] * (1 + i % 40), SamplingParams(max_tokens=2))
            i += 1
            print(i, flush=True)
            eng.step()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    acked = 0
    deadline = time.time() + 120
    while acked < 50 and time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert acked >= 50, "the capturing process did not get going"
    t = read_trace(path)
    assert len(t) >= acked                  # every acknowledged request is on disk
    assert [r.prompt_token_ids[0] for r in t] == [5 + i % 200 for i in range(len(t))]


def test_capture_is_a_subscriber(tiny_llama_dir, tmp_path):
    from workbench import Workbench
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    cap = Workbench(eng, log=False).capture(tmp_path / "wb.jsonl")
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    cap.close()
    eng.add_request([8, 9], SamplingParams(max_tokens=2))      # after close: not recorded
    t = read_trace(tmp_path / "wb.jsonl")
    assert [r.id for r in t] == [rid] and t[0].prompt_token_ids == [5, 6, 7]


def test_engine_imports_no_consumer():
    # The engine emits; trace/, widgets/, export/ and probes/ subscribe. Importing it (and
    # building one) must not pull any of them in.
    code = textwrap.dedent("""
        import sys
        import workbench.engine
        from workbench.engine import engine, model, batch, scheduler, kv_manager, pages, instrumentation
        bad = sorted(m for m in sys.modules if m.startswith(("workbench.trace", "workbench.widgets",
                     "workbench.export", "probes")))
        print(",".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"workbench.engine imported {out.stdout.strip()}"
