"""Where the plugin's findings, statuses and step records go: the workbench's socket, and vLLM's log.

One Reporter per vLLM process. With no usable address (or none listening) nothing is lost
from the log: findings at `error` and `warn` are written there too, once per condition,
so a deployment with no workbench attached still says what the checks saw.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
import time

from . import status as st

_LOG_EVERY = 1000          # an exception that repeats: logged the 1st, then every 1000th time
STATUS_EVERY_S = 5.0


class Reporter:
    def __init__(self, address: str | None):
        self.address = address
        self.pub = None
        self.broken = False
        self.reported: set = set()          # persistent conditions are reported once
        self.errors: dict[str, int] = {}
        self.statuses: dict[str, st.CheckStatus] = {}
        self._status_sent = 0.0
        self._ticker: threading.Thread | None = None
        self.on_finding = None                 # callable(finding dict): the flight recorder, where one runs

    def _publisher(self):
        if self.pub is not None and self.pub.pid != os.getpid():
            self.pub = None              # a forked child: the parent's sender thread is not here; its own
        if self.pub is None and self.address and not self.broken:
            try:
                from .stream import Publisher
                self.pub = Publisher(self.address)
                atexit.register(self.pub.flush, 0.5)     # what is queued still goes when the process exits
                import vllm
                self.pub.send(b"hello", {"pid": os.getpid(), "process": multiprocessing.current_process().name,
                                         "vllm_version": getattr(vllm, "__version__", "?")})
                time.sleep(0.05)            # let the connection settle so the first messages arrive
            except Exception as e:          # a bad address or no ZMQ: the log is all we have
                self.broken = True
                st.problem(f"cannot send to the workbench at {self.address!r} ({type(e).__name__}: {e}); "
                           f"findings go to this log only")
        return self.pub

    def send(self, kind: bytes, header: dict, arrays=()) -> None:
        pub = self._publisher()
        if pub is not None:
            try:
                pub.send(kind, header, arrays)
            except Exception as e:
                self.error("sending to the workbench", e)

    def status(self, s: st.CheckStatus, say: bool = True) -> None:
        old = self.statuses.get(s.check)
        self.statuses[s.check] = s
        if say and (old is None or old.line() != s.line()):
            st.say(s)
        self.send(b"status", s.as_dict())
        if self._ticker is None and self.address and not self.broken:
            # repeated while vLLM idles too, so `kvwb vllm status` answers at any time
            self._ticker = threading.Thread(target=self._tick, name="kvwb-plugin-status", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self.broken:
            time.sleep(STATUS_EVERY_S)
            try:
                self.resend_statuses(0.0)
            except Exception:
                return

    def resend_statuses(self, every_s: float = STATUS_EVERY_S) -> None:
        now = time.monotonic()
        if now - self._status_sent >= every_s and self.statuses:
            self._status_sent = now
            for s in list(self.statuses.values()):
                self.send(b"status", s.as_dict())

    def findings(self, found: list[dict], key) -> None:
        for f in found:
            k = key(f)
            if k in self.reported:
                continue
            if len(self.reported) > 100_000:      # bounded: a fault left on for days must not grow vLLM
                self.reported.clear()
            self.reported.add(k)
            self.send(b"finding", f)
            if self.on_finding is not None:          # the flight recorder (engine core process)
                try:
                    self.on_finding(f)
                except Exception as e:
                    st.problem(f"flight recorder: {type(e).__name__}: {e}")
            if f.get("severity") in ("error", "warn"):
                st.log.warning("PagedKV Workbench %s %s [%s]: %s", f.get("probe"), f.get("severity"),
                               f.get("kind"), f.get("message"))

    def inactive(self, probe: str, check: str, steps: int, why: str) -> None:
        """A check that should have run and has not: one `check-inactive` warning per check."""
        from .sanitizer import inactive_finding
        self.findings([inactive_finding(probe, check, steps, why)], key=lambda f: ("check-inactive", check))

    def error(self, where: str, e: BaseException) -> None:
        """An exception inside one of our checks: logged (rate-limited), sent, never raised into vLLM."""
        try:
            key = f"{where}: {type(e).__name__}"
            n = self.errors[key] = self.errors.get(key, 0) + 1
            if n == 1 or n % _LOG_EVERY == 0:
                st.problem(f"{where} failed ({type(e).__name__}: {e}); vLLM goes on"
                           + (f" [{n} times]" if n > 1 else ""))
            self.send(b"error", {"message": f"{where}: {type(e).__name__}: {e}"})
        except Exception:
            pass
