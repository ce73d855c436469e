"""Whether the ranks of a tensor-parallel engine are alive, and what to say when one is not.

A mixin of the Driver (driver.py): waiting for every rank at start-up, a rank's liveness (its process,
or its pid under torchrun) and the error it left in the store, and the one way a group ends when a
rank died, hung or was interrupted mid-step: RankFailed naming the rank (exit code or signal, or its
error), the others shut down, the engine refusing further steps.
"""
from __future__ import annotations

import signal
import time

from .group import pid_alive


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel engine died, hung or failed; the message names it."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RankHealth:
    # ---- start-up --------------------------------------------------------------------------
    def _wait_for(self, key: str, deadline: float) -> None:
        todo = set(range(1, self.world))
        while todo:
            for r in sorted(todo):
                if self.store.check([f"{key}/{r}"]):
                    todo.discard(r)
            if not todo:
                return
            dead = self._dead_ranks()
            if dead:
                raise RankFailed(f"tensor-parallel start-up failed: {self._describe(dead)}")
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel start-up: ranks {sorted(todo)} did not get to '{key}' within "
                                 f"{self.startup_s:.0f} s ({self._describe(sorted(todo))})")
            time.sleep(0.05)

    # ---- liveness and diagnosis ------------------------------------------------------------
    def _alive(self, r: int) -> bool:
        p = self.procs.get(r)
        if p is not None:
            return p.exitcode is None
        pid = self.pids.get(r)
        return True if pid is None else pid_alive(pid)

    def _error_of(self, r: int) -> str | None:
        try:
            if self.store.check([f"error/{r}"]):
                return self.store.get(f"error/{r}").decode()
        except Exception:                        # noqa: BLE001 - a store that is gone tells nothing
            pass
        return None

    def _dead_ranks(self) -> list[int]:
        return [r for r in range(1, self.world) if not self._alive(r) or self._error_of(r) is not None]

    def _describe(self, ranks) -> str:
        parts = []
        for r in ranks:
            pid = self.pids.get(r, "?")
            err = self._error_of(r)
            p = self.procs.get(r)
            state = _exit_text(p.exitcode) if p is not None else ("running" if self._alive(r) else "gone")
            first = err.strip().splitlines()[0] if err else None
            parts.append(f"rank {r} (pid {pid}) {state}" + (f", after: {first}" if first else ""))
        return "; ".join(parts)

    def _fail(self, e: BaseException, what: str) -> None:
        """A collective (or the forward between them) failed: name the rank, end the group, raise."""
        dead = self._dead_ranks()
        t_end = time.monotonic() + 2.0              # a killed rank's exit code shows a moment later
        while not dead and time.monotonic() < t_end and not isinstance(e, KeyboardInterrupt):
            time.sleep(0.05)
            dead = self._dead_ranks()
        if isinstance(e, KeyboardInterrupt):
            why = f"interrupted during {what}"
        elif dead:
            why = f"{self._describe(dead)} during {what}"
        elif "timed out" in str(e).lower() or "timeout" in str(e).lower():
            why = (f"a rank did not answer within {self.timeout_s:.0f} s during {what} "
                   f"({self._describe(range(1, self.world))})")
        else:
            why = f"{type(e).__name__}: {e} during {what} ({self._describe(range(1, self.world))})"
        self.broken = why
        self._reap(force=True)
        if isinstance(e, KeyboardInterrupt):
            raise e
        raise RankFailed(f"tensor-parallel engine: {why}; the other ranks were shut down, build a new engine") from e

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RankFailed(f"tensor-parallel engine is unusable: {self.broken}; build a new engine")
        if self.closed:
            raise RankFailed("tensor-parallel engine is closed")
        dead = [r for r in range(1, self.world) if not self._alive(r)]
        if dead:
            self.broken = f"{self._describe(dead)} before step {self.steps + 1}"
            self._reap(force=True)
            raise RankFailed(f"tensor-parallel engine: {self.broken}; the other ranks were shut down, "
                             f"build a new engine")
