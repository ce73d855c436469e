"""The workbench's end of the sanitizer stream: findings, pool snapshots and step times from vLLM.

Binds a SUB socket on 127.0.0.1 (the plugin's processes connect to it) and reads in a
daemon thread. A malformed message is recorded in `errors` and skipped; the last good
pool snapshot stays. Nothing here raises into the caller once started.
"""
from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import numpy as np

from ...findings import SEVERITY_RANK, Finding
from ...trace.timetravel import PoolState
from .stream import decode

MAX_ERRORS = 100


def check_local_address(address: str, what: str) -> str:
    """A tcp://127.0.0.1:PORT (or localhost, ::1) or ipc:// address; ValueError naming what is wrong."""
    if address.startswith("ipc://"):
        return address
    u = urlparse(address)
    if u.scheme != "tcp" or u.port is None:
        raise ValueError(f"{what} {address!r}: give tcp://127.0.0.1:PORT (or ipc://PATH)")
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"{what} {address!r}: the workbench binds only 127.0.0.1 (give tcp://127.0.0.1:{u.port})")
    return f"tcp://127.0.0.1:{u.port}" if u.hostname == "localhost" else address


class SanitizerListener:
    def __init__(self, address: str = "tcp://127.0.0.1:5590", poll_ms: int = 100, on_step=None,
                 inactive_after: int = 64):
        import zmq
        self.address = check_local_address(address, "sanitizer address")
        self.ctx = zmq.Context()             # its own: closing it releases the port at once (rebinding works)
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as e:
            self.sock.close(0)
            self.ctx.term()
            raise ValueError(f"sanitizer address {self.address}: cannot bind ({e})") from None
        self.poll_ms = poll_ms
        self.on_step = on_step                # on_step(header) after each step snapshot, on the thread
        self.lock = threading.Lock()
        self.findings: list[Finding] = []
        self.errors: list[str] = []
        self.processes: list[dict] = []
        self.attention_costs: dict[str, dict] = {}   # process -> the attention check's checks, time, errors
        self.costs: dict[str, dict] = {}      # process -> {checks, check_s, executions}: the worker's metadata checks
        self.statuses: dict[str, dict] = {}   # check -> {check, active, via, path, reason, process}
        self.inactive_after = inactive_after  # engine steps with work and no worker heartbeat: check-inactive
        self._meta_seen_at = 0                # the engine step count when the worker's checks last advanced
        self._inactive_said = False
        self.steps: list[dict] = []           # one row per step header (step, t, step_s, check_s, ...)
        self.names: dict[int, str] = {}       # owner index -> vLLM request id
        self.pool: PoolState | None = None
        self.idle_hashes: list | None = None  # the block hashes vLLM's pool held at its last idle step
        self.messages = 0
        self.last_message: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwb-vllm-sanitizer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        while not self._stop.is_set():
            try:
                if not self.sock.poll(self.poll_ms):
                    continue
                frames = self.sock.recv_multipart()
            except zmq.ZMQError as e:
                if not self._stop.is_set():
                    self._error(f"sanitizer socket: {e}")
                return
            try:
                self._apply(*decode(frames))
            except (ValueError, KeyError, TypeError) as e:
                self._error(str(e))

    def _apply(self, kind: str, header: dict, arrays: dict) -> None:
        with self.lock:
            self.messages += 1
            self.last_message = time.time()
            if kind == "hello":
                self.processes.append(header)
            elif kind == "finding":
                sev = header.get("severity", "error")
                if sev not in SEVERITY_RANK:
                    raise ValueError(f"sanitizer finding with severity {sev!r}")
                self.findings.append(Finding(
                    probe=str(header.get("probe", "vllm")), severity=sev, message=str(header.get("message", "")),
                    hint=str(header.get("hint", "")), kind=str(header.get("kind", "")), step=header.get("step"),
                    request_id=header.get("request_id"), page=header.get("page"),
                    evidence=dict(header.get("evidence") or {})))
            elif kind == "cost" and header.get("check") == "vllm_attention":    # the attention check's own
                self.attention_costs[str(header.get("process", "?"))] = {
                    k: header.get(k) for k in ("checks", "check_s", "executions", "max_err", "skipped")}
            elif kind == "cost":                  # cumulative per process: a lost message loses nothing
                proc = str(header.get("process", "?"))
                old = self.costs.get(proc, {}).get("checks", 0)
                self.costs[proc] = {"checks": int(header.get("checks", 0)), "check_s": float(header.get("check_s", 0.0)),
                                    "executions": int(header.get("executions", 0)),
                                    "groups": {int(k): int(v) for k, v in (header.get("groups") or {}).items()}}
                if self.costs[proc]["checks"] > old:
                    self._meta_seen_at = len(self.steps)
            elif kind == "status":
                check = str(header.get("check", "?"))
                self.statuses[check] = {k: header.get(k) for k in ("check", "active", "via", "path", "reason")}
            elif kind == "error":
                self._error(f"in vLLM: {header.get('message')}")
            elif kind == "step":
                self.names.update({int(k): v for k, v in (header.get("names") or {}).items()})
                lo = header.get("slice_lo")
                if arrays and lo is None:         # a full sweep's snapshot
                    self.pool = PoolState(int(header["step"]), arrays["ref"].astype(np.int32),
                                          arrays["owner"].astype(np.int64), arrays["cached"].astype(bool))
                elif arrays:                      # a rotating slice: patched into a copy of the last snapshot
                    self.pool = _patched(self.pool, int(header["step"]), int(header["num_blocks"]), int(lo), arrays)
                row = {k: header.get(k) for k in ("step", "t", "step_s", "check_s", "num_blocks", "num_free",
                                                  "running", "waiting", "hashed", "full", "idle_sweep", "process",
                                                  "hits_checked", "dropped")}
                self.steps.append(row)
                self._judge_inactive()
                if "hashes" in header:            # sent at idle: the pool's prefix-cache blocks
                    self.idle_hashes = list(header["hashes"])
        if kind == "step" and self.on_step is not None:
            try:
                self.on_step(row)
            except Exception as e:           # a consumer's bug is reported, the stream goes on
                self._error(f"on_step: {type(e).__name__}: {e}")

    def _judge_inactive(self) -> None:
        """The metadata check runs in vLLM's workers: engine steps with work and no sign of it there
        (no worker heartbeat at all, or one that stopped advancing) are a `check-inactive` warning."""
        busy = sum(1 for r in self.steps[self._meta_seen_at:] if r.get("running"))
        if busy < self.inactive_after or self._inactive_said:
            return
        st = self.statuses.get("vllm_metadata")
        if st is not None and not st.get("active"):
            return                                # the plugin already said it is not active, and why
        self._inactive_said = True
        why = ("no worker process has sent a metadata check" if not self.costs
               else "the workers' metadata checks stopped advancing")
        self.findings.append(Finding(
            probe="vllm_metadata", severity="warn", kind="check-inactive", step=self.steps[-1].get("step"),
            message=f"vllm_metadata has not run for {busy} engine steps with running requests: {why}",
            hint="the plugin's status lines in vLLM's log (`kvwb vllm status`) say which hook it waits on",
            evidence={"check": "vllm_metadata", "steps": busy, "statuses": dict(self.statuses)}))

    def _error(self, msg: str) -> None:
        if not self.errors or self.errors[-1] != msg:
            self.errors.append(msg)
            del self.errors[:-MAX_ERRORS]

    def settle(self, quiet_s: float = 0.1, max_s: float = 1.0) -> None:
        """Return once no message has arrived for quiet_s since this call (at most max_s): after its
        senders have exited, what they sent is in this host's socket buffers, read within a poll or two.
        Quiet is counted from the call, not from the last message read: one sent just before the exit
        may not have been read yet."""
        start, end = time.time(), time.monotonic() + max_s
        while time.monotonic() < end:
            with self.lock:
                last = self.last_message
            idle = time.time() - max(start, last or start)
            if idle >= quiet_s:
                return
            time.sleep(min(quiet_s - idle, max(0.0, end - time.monotonic())) + 1e-3)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.sock.close(0)
        self.ctx.term()


def _patched(pool, step: int, n: int, lo: int, arrays: dict):
    """The last snapshot with one slice replaced (a new PoolState: views handed out keep theirs). Before
    the first full snapshot, the blocks no slice has reached yet read as free."""
    if pool is None or len(pool.ref) != n:
        ref, owner, cached = np.zeros(n, np.int32), np.full(n, -1, np.int64), np.zeros(n, bool)
    else:
        ref, owner, cached = pool.ref.copy(), pool.owner.copy(), pool.cached.copy()
    hi = lo + len(arrays["ref"])
    ref[lo:hi], owner[lo:hi], cached[lo:hi] = arrays["ref"], arrays["owner"], arrays["cached"].astype(bool)
    return PoolState(step, ref, owner, cached)
