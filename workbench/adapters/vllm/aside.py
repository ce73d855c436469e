"""The engine-core checks' own thread: what the plugin checks of a step runs while vLLM's forward does.

vLLM's engine-core thread calls Scheduler.schedule, hands the SchedulerOutput to the executor and
waits for the forward (a future, a message queue, or in one process the forward itself, whose
torch ops release the GIL), then calls Scheduler.update_from_output. Between schedule() returning
and update_from_output() starting, nothing on that thread changes the scheduler's lists or the
block pool. So the ledger, the prefix provenance, forward progress and the pool check of the state
schedule() left are handed to this thread when schedule() returns (`submit`), and every vLLM call
that changes that state waits for them first (`drain`): update_from_output, the next schedule,
add_request, finish_requests (an abort), reset_prefix_cache. The check sees exactly the state
schedule() left, as it would inline, and its findings are out before update_from_output runs: late
by no step. What vLLM's thread pays is the hand-off and, where the forward is shorter than the
checks, the rest of the checks at the drain.

PAGEDKV_VLLM_CHECK_THREAD=0 runs every job inline, on vLLM's thread (the old behaviour: for a
profile, or a platform where a thread of ours is unwelcome).
"""
from __future__ import annotations

import threading
import time
from collections import deque


class Aside:
    """One worker thread, jobs in submission order; `drain` waits for all submitted so far."""

    def __init__(self, on_error, threaded: bool = True, name: str = "kvwb-plugin-checks"):
        self.on_error = on_error                  # (where, exception): a job's failure is one log line
        self.threaded = threaded
        self.name = name
        self._jobs: deque = deque()
        self._cv = threading.Condition()
        self._pending = 0                         # submitted and not finished (read unlocked by drain)
        self._thread: threading.Thread | None = None
        self.jobs = 0                             # jobs run, for the status and the benchmark
        self.waited_s = 0.0                       # time vLLM's thread spent in drain() waiting for them

    def submit(self, where: str, fn, *args) -> None:
        if not self.threaded:
            self._run(where, fn, args)
            return
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.append((where, fn, args))
            self._pending += 1
            self._cv.notify_all()

    def drain(self) -> None:
        """Return once every job submitted so far has run (at once when none is pending)."""
        if not self._pending or threading.current_thread() is self._thread:
            return
        t0 = time.perf_counter()
        with self._cv:
            while self._pending:
                self._cv.wait(1.0)
                if self._pending and (self._thread is None or not self._thread.is_alive()):
                    break                         # the thread died (interpreter exit): never hang vLLM
        self.waited_s += time.perf_counter() - t0

    def _run(self, where, fn, args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.on_error(where, e)
        self.jobs += 1

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                where, fn, args = self._jobs.popleft()
            self._run(where, fn, args)
            with self._cv:
                self._pending -= 1
                if not self._pending:
                    self._cv.notify_all()
