"""Does the plugin run on this machine's vLLM, with vLLM's own defaults? One short, printed answer.

For a GPU (scripts/check_vllm_cuda.py) or an Ascend NPU with vllm-ascend
(scripts/check_vllm_ascend.py), and for this CPU build (tests/test_vllm_hwcheck.py). It installs
nothing: it uses the vLLM of the Python that runs it. It starts vLLM's OpenAI server with its
defaults for the platform (no runner or scheduling setting of ours: on CUDA that is the V2 model
runner, async scheduling and CUDA graphs), the plugin on, a fault file it controls; runs a short
mixed workload clean (long and short prompts, a shared prefix, so prefill, chunked prefill,
decode and prefix hits mix), then again with one planted fault (`permuted_block_table_rows`), and
prints which checks ran, on which path, and whether the fault was caught, naming the request.

    python scripts/check_vllm_cuda.py --model /path/to/hf_model_dir
Exit 0: both checks active, the clean run silent, the fault caught.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from .faults import write_fault_file
from .server import free_port

SYSTEM = "You answer questions about paged KV caches briefly and precisely. " * 6
QUESTIONS = ["What is a page table?", "Explain prefix caching in two sentences.", "Why do pages fragment?",
             "What does cu_seqlens hold?", "Name one cause of a KV-cache leak.", "What is a block table row?",
             "What does a slot mapping map?", "Why is fp16 K/V risky?"]


class Collector:
    """A SUB socket on 127.0.0.1 taking the plugin's messages (stream.py's schema), in a thread."""

    def __init__(self, address: str):
        import zmq
        from .stream import decode
        self._decode = decode
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.statuses, self.findings, self.errors, self.costs = {}, [], [], {}
        self.steps = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            try:
                kind, h, _ = self._decode(self.sock.recv_multipart())
            except Exception as e:
                self.errors.append(str(e))
                continue
            if kind == "status":
                self.statuses[h["check"]] = h
            elif kind == "finding":
                self.findings.append(h)
            elif kind == "error":
                self.errors.append(h.get("message"))
            elif kind == "cost":
                self.costs[(h.get("process"), h.get("check", "vllm_metadata"))] = h
            elif kind == "step":
                self.steps += 1

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.sock.close(0)
        self.ctx.term()


def _server(model: str, port: int, sanitizer: str, faults: str, log: Path, extra: list[str]):
    import subprocess
    env = dict(os.environ, PAGEDKV_VLLM_SANITIZER=sanitizer, PAGEDKV_VLLM_FAULT_FILE=faults)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "m",
           "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching", "--max-model-len", "2048", *extra]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _burst(url: str, n_tokens: int) -> list[str]:
    import concurrent.futures as cf
    import urllib.request

    def one(i):
        q = QUESTIONS[i % len(QUESTIONS)] + (" Add detail." * (i * 9) if i % 3 == 0 else "")
        body = json.dumps({"model": "m", "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
                           "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        req = urllib.request.Request(url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    with cf.ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, range(12)))


def check(model: str, expect: str, extra: list[str], timeout_s: float = 900) -> int:
    import signal
    import urllib.request
    tmp = Path(tempfile.mkdtemp(prefix="kvwb-hwcheck-"))
    faults = str(tmp / "faults.json")
    write_fault_file(faults)
    sanitizer, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    col = Collector(sanitizer)
    log = tmp / "vllm.log"
    proc = _server(model, port, sanitizer, faults, log, extra)
    url = f"http://127.0.0.1:{port}"
    ok = True
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                print(f"vLLM exited ({proc.returncode}) while starting; its log: {log}")
                print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
                return 2
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.time() - t0 > timeout_s:
                    print(f"vLLM did not start within {timeout_s:.0f} s; its log: {log}")
                    return 2
                time.sleep(0.25)                  # a start is seconds: poll often, lose little
        print(f"vLLM started in {time.time() - t0:.0f} s ({expect}); log {log}")
        clean = _burst(url, 24)
        time.sleep(1.5)
        clean_found = [f for f in col.findings if f.get("severity") in ("warn", "error", "critical")]
        write_fault_file(faults, "permuted_block_table_rows")
        time.sleep(1.0)
        faulty = _burst(url, 24)
        time.sleep(1.5)
        write_fault_file(faults)
        caught = [f for f in col.findings[len(clean_found):] if f.get("kind") == "block-table"]
        print("checks (the plugin's status lines):")
        for name in ("vllm_pool", "vllm_metadata", "vllm_attention"):
            s = col.statuses.get(name)
            # the attention check is reported, not required: full CUDA graphs replay attention without Python
            required = name != "vllm_attention"
            if s is None:
                ok &= not required
                print(f"  {name}: no status heard")
                continue
            ok &= bool(s.get("active")) or not required
            print(f"  {name}: {'active via ' + s['via'] if s.get('active') else 'NOT active'} ({s.get('path')})"
                  + (f"; {s['reason']}" if s.get("reason") else ""))
        checks = sum(int(c.get("checks", 0)) for (_, k), c in col.costs.items() if k == "vllm_metadata")
        attn = sum(int(c.get("checks", 0)) for (_, k), c in col.costs.items() if k == "vllm_attention")
        print(f"ran: pool check {col.steps} steps, metadata check {checks} batches, attention check {attn} rows")
        ok &= col.steps > 0 and checks > 0
        print(f"clean run: {len(clean_found)} findings >= warn" + "".join(f"\n  {f['message']}" for f in clean_found))
        ok &= not clean_found
        changed = sum(a != b for a, b in zip(clean, faulty))
        print(f"planted permuted_block_table_rows: {changed}/{len(clean)} outputs changed; "
              + (f"caught: {caught[0]['message']}" if caught else "NOT caught"))
        ok &= bool(caught)
        if col.errors:
            print("plugin errors: " + "; ".join(map(str, col.errors[:5])))
        # one verdict line per check, for a first run on hardware to read at a glance
        st_of = lambda name: col.statuses.get(name) or {}
        verdicts = [
            ("vllm_pool", bool(st_of("vllm_pool").get("active")) and col.steps > 0, f"{col.steps} steps"),
            ("vllm_metadata", bool(st_of("vllm_metadata").get("active")) and checks > 0, f"{checks} batches"),
            ("vllm_attention", None if not attn else True,
             f"{attn} rows" if attn else "reported, not required (no row checked: full CUDA graphs run no Python)"),
            ("clean run silent", not clean_found, f"{len(clean_found)} findings >= warn"),
            ("planted fault caught", bool(caught), "permuted_block_table_rows")]
        for name, good, what in verdicts:
            print(f"VERDICT {name}: {'INFO' if good is None else 'PASS' if good else 'FAIL'} ({what})")
        print("RESULT " + ("PASS" if ok else "FAIL"))
        return 0 if ok else 1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except Exception:
            pass
        col.close()


def main(expect: str, argv=None) -> int:
    ap = argparse.ArgumentParser(description=f"the workbench's vLLM plugin on this machine's vLLM ({expect})")
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (nothing is downloaded)")
    ap.add_argument("--vllm-arg", action="append", default=[], help="an extra vLLM server argument (repeatable)")
    a = ap.parse_args(argv)
    return check(a.model, expect, a.vllm_arg)
