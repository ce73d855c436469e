"""Local stand-ins for a vLLM server's endpoints, shared by the vLLM adapter tests.

MetricsServer serves Prometheus text at /metrics over real HTTP on 127.0.0.1; free_port and
free_addr name loopback ports nothing listens on; wait_until polls a condition. Each test file
keeps its own VLLM_TEXT."""
from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout=5.0) -> bool:
    """Poll cond() until it holds (True) or timeout seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def free_addr() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class MetricsServer:
    """A local /metrics server whose .text the test can change, and .stop() (more than once)."""

    def __init__(self, text: str):
        self.text = text
        self.hits = 0                                      # GET requests, any path
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits += 1
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self._stopped = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
