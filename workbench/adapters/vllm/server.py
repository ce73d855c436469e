"""VllmServer: start a real vLLM OpenAI server (CPU build, its own venv) with the plugin and KV events on.

For the tests, the watch_your_vllm notebook and the plugin benchmark; a user with a vLLM of
their own starts it as they always do, adding the two settings this class adds:

    PAGEDKV_VLLM_SANITIZER=tcp://127.0.0.1:5590  (the plugin on; the workbench binds it)
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'

With a tcp://127.0.0.1 endpoint vLLM's publisher connects and the workbench binds: nothing
listens on another interface. The server itself binds 127.0.0.1. The vLLM environment is
.venv-vllm (make vllm) or $PAGEDKV_VLLM_PYTHON.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def vllm_python() -> Path:
    return Path(os.environ.get("PAGEDKV_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def free_port() -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range. A port the kernel picks (bind to 0)
    comes from that range, where any outgoing connection (the /metrics scraper opens one per scrape)
    may take it in the seconds before vLLM binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:                         # a crowded host: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model: str | Path | None = None, port: int | None = None, *, sanitizer: str | None = None,
                 kv_events: str | None = None, kv_replay: str | None = None, fault_file: str | None = None,
                 block_size: int = 32, max_num_seqs: int = 16, max_model_len: int = 2048, dtype: str = "bfloat16",
                 kv_cache_gib: float = 1, num_blocks: int | None = None, log_path: str | Path | None = None,
                 extra_args=(), extra_env: dict | None = None):
        from .model_dir import DEFAULT_DIR
        self.model = str(model or DEFAULT_DIR)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or f"/tmp/kvwb-vllm-{self.port}.log")
        py = vllm_python()
        if not py.exists():
            raise FileNotFoundError(f"{py}: no vLLM environment; run `make vllm` (or set PAGEDKV_VLLM_PYTHON)")
        # vLLM's CPU build: the V1 model runner, a fixed KV size (GiB), no thread pinning on a small host
        env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("PAGEDKV_VLLM_SANITIZER", None)
        if sanitizer:
            env["PAGEDKV_VLLM_SANITIZER"] = sanitizer
        if fault_file:
            env["PAGEDKV_VLLM_FAULT_FILE"] = str(fault_file)
        env.update(extra_env or {})
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", "smollm2", "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--block-size", str(block_size), "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
               "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(self.port)]
        if num_blocks:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        if kv_events:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events}
            if kv_replay:
                cfg["replay_endpoint"] = kv_replay
            cmd += ["--kv-events-config", json.dumps(cfg)]
        self.cmd = cmd + list(extra_args)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300) -> "VllmServer":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting; last lines of "
                                   f"{self.log_path}:\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                self.started_s = time.time() - t0
                return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"vLLM did not answer {self.url}/health within {timeout_s:.0f} s; see {self.log_path}")

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def chat(self, messages, max_tokens: int = 32, timeout_s: float = 300, **extra) -> dict:
        """One greedy chat completion (the response as JSON)."""
        body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                           **extra}).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def burst(self, questions, system: str = "", workers: int = 6, max_tokens: int = 20):
        """Chat completions for each question (after a shared system prompt), sent concurrently;
        returns (vLLM's response ids, the answers), in the questions' order."""
        import concurrent.futures as cf

        def one(q):
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
            return self.chat(msgs, max_tokens=max_tokens)
        with cf.ThreadPoolExecutor(workers) as ex:
            res = list(ex.map(one, questions))
        return [r["id"] for r in res], [r["choices"][0]["message"]["content"] for r in res]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)        # the server and its engine / worker processes
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
