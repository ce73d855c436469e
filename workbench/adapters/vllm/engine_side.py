"""The engine-core side of the plugin: vLLM's block pool checked against our own ledger.

Hooked on what every step path shares (issue 26): `Scheduler.schedule` (each SchedulerOutput
goes into the ledger as it crosses to the workers) and `Scheduler.update_from_output` (the
pool is checked once the step's results are applied). EngineCore.step and
EngineCore.step_with_batch_queue (async scheduling, pipeline parallel) both call these two,
so the check runs whichever one vLLM picked; the status line says which (EngineCore picks the
batch queue exactly when vllm_config.max_concurrent_batches > 1).

Each check looks at the blocks the step touched (allocated, freed, evicted) and a rotating slice
of the pool (pool_sweep.py); the full sweep walks the whole pool and sends its snapshot (one entry
per block) for the page map when vLLM goes idle, on the plugin's own thread. Prefix provenance
(provenance_check.py) and forward progress run at schedule time.

Where they run (aside.py): the ledger, provenance, progress and the pool check of the state
schedule() left run on the checks' own thread while vLLM's forward runs, and are done before
vLLM's next call that changes that state (update_from_output first). So the pool is checked as
schedule() left it, each step; a request finished inside update_from_output is let go at once (on
vLLM's thread: a few dict operations), and its blocks are checked at the next schedule, or by the
idle sweep when none follows. The step message for step N (its duration, the slice's snapshot)
goes out during step N+1's forward.
"""
from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np

from probes.progress import stalled

from . import sanitizer
from . import status as st
from .aside import Aside
from .ledger import BlockLedger, GroupRule
from .pool_sweep import PoolSweep, in_queue
from .provenance_check import ProvenanceCheck


class PoolWatch(ProvenanceCheck, PoolSweep):
    """The engine-core side's state and its callbacks; the prefix provenance (provenance_check.py) and
    the pool's rotating slice and full sweep (pool_sweep.py) are mixed in."""
    def __init__(self, rep, settings):
        self.rep, self.s = rep, settings
        self.ledger: BlockLedger | None = None
        self.t_sched: dict[int, tuple[float, int]] = {}   # id(SchedulerOutput) -> (schedule time, its step)
        self.touched: set[int] = set()
        self.step = 0                    # update_from_output calls seen
        self.checks = 0
        self.since_check = 0             # schedule outputs with tokens since the last pool check
        self.names: dict[str, int] = {}
        self.next_name = 0
        self.check_s = 0.0
        self._sweeper: threading.Thread | None = None
        self._wake: threading.Event | None = None
        self._idle_at = None
        self.rules: list[GroupRule | None] = []       # per KV cache group; None: not modelled (its own lists pin)
        self.prov: dict = {}                          # per KV cache group the ledger models: ProvenanceLedger
        self.progress: dict[str, int] = {}            # request -> the last step it was scheduled (or arrived)
        self.progress_t: dict[str, float] = {}        # request -> when it was first seen waiting since then
        self.stall_said: set[str] = set()
        self.saturated_at = 0                         # the last step the scheduler had no seat or budget left
        self.crc: dict[tuple[str, int], tuple[int, int]] = {}   # (request, group) -> (blocks digested, digest)
        self.recorder = None                          # the flight recorder (recording.py), in this process
        self.cursor = 0                               # the next block the rotating slice check reads
        self.prefix_resets = 0                        # vLLM's prefix-cache resets seen (on_prefix_reset)
        self.scheduled = 0                            # schedule calls seen (the ledger's steps, counted on vLLM's thread)
        self.last_facts: dict | None = None           # the last finished step's figures for its message (_facts)
        self.checked_at = 0                           # the step the running check names in its findings
        self._check_lock = threading.Lock()           # the step's check and the idle sweep: one at a time
        self.aside = Aside(rep.error, threaded=getattr(settings, "check_thread", True))

    def drain(self) -> None:
        """Wait for the checks' thread: vLLM is about to change what they read (aside.py)."""
        self.aside.drain()

    def _new_ledger(self, scheduler) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        if not self.rules:
            self.rules, _ = group_rules(scheduler)
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.ledger = BlockLedger(len(pool.blocks), [r or GroupRule("unmodelled") for r in self.rules],
                                  [int(g.kv_cache_spec.block_size) for g in groups],
                                  getattr(getattr(pool, "null_block", None), "block_id", None))

    # ---- the hooks' callbacks -------------------------------------------------------------
    def on_prefix_reset(self, pool, done) -> None:
        """vLLM's BlockPool.reset_prefix_cache returned: when it did reset (every block free, every hash
        gone), no block can be hit before it is filled again, which writes a new record: the provenance
        records go now rather than linger until their blocks are refilled."""
        if not done:
            return                       # refused (blocks still held): nothing changed in vLLM
        self.prefix_resets += 1
        for prov in self.prov.values():
            prov.rec.clear()

    def on_scheduler_ready(self, scheduler) -> None:
        # EngineCore picks step_with_batch_queue exactly when max_concurrent_batches > 1
        cfg = getattr(scheduler, "vllm_config", None)
        size = int(getattr(cfg, "max_concurrent_batches", 1) or 1)
        name = type(scheduler).__name__
        path = (f"EngineCore.step_with_batch_queue, batch queue size {size}, {name}" if size > 1
                else f"EngineCore.step, synchronous, {name}")
        path += ("; checks on their own thread during the forward" if self.aside.threaded
                 else "; checks inline on vLLM's thread")
        self.rules, reason = group_rules(scheduler)
        if self.s.record_dir and self.recorder is None:
            try:
                from .recording import VllmRecorder
                rec = VllmRecorder(self.s)
                rec.start(scheduler)
                self.recorder = rec
                self.rep.on_finding = rec.note_finding
            except Exception as e:                    # a recorder that cannot start leaves the checks on
                st.problem(f"flight recorder not started: {type(e).__name__}: {e} ({self.s.record_dir})")
        self.rep.status(st.CheckStatus(st.CHECK_POOL, True, "Scheduler.schedule + Scheduler.update_from_output",
                                       path, reason))

    def on_schedule(self, scheduler, so, t0: float) -> None:
        """On vLLM's thread: the step's bookkeeping, then the checks handed to their own thread."""
        self.scheduled += 1
        self.t_sched[id(so)] = (t0, self.scheduled)   # the batch queue overlaps outputs: keep each one's step
        if len(self.t_sched) > 64:                    # outputs never returned (an engine error): bounded
            self.t_sched.pop(next(iter(self.t_sched)))
        if getattr(so, "total_num_scheduled_tokens", 0):
            self.since_check += 1
        if self.since_check >= self.s.inactive_after:
            self.rep.inactive(sanitizer.PROBE_POOL, st.CHECK_POOL, self.since_check,
                              "Scheduler.update_from_output never returned through the plugin's hook")
        self.aside.submit("pool check", self._after_schedule, scheduler, so, self.scheduled)

    def _after_schedule(self, scheduler, so, n: int) -> None:
        """On the checks' thread, during the forward: the ledger, the recorder, provenance, progress, and
        the pool as schedule() left it."""
        t_in = time.perf_counter()
        if self.ledger is None:
            self._new_ledger(scheduler)
        d = self.ledger.apply(so)
        self.touched |= d.touched()
        if self.recorder is not None:
            self._record("on_schedule", scheduler, so, d, self.ledger.steps)
        self._forget(d.released)
        self._provenance(scheduler, so, d.added)
        self._progress(scheduler, so)
        self.check_s += time.perf_counter() - t_in     # the ledger and provenance count as the check's cost
        if n % self.s.pool_every == 0:
            self.check(scheduler, None, False)            # the step's duration is in last_facts

    def on_update(self, scheduler, so, outputs=None) -> None:
        """On vLLM's thread, once update_from_output returned (the checks' thread drained before it ran).
        outputs: what it returned (client index -> EngineCoreOutputs)."""
        t0, so_step = self.t_sched.pop(id(so), (None, None))
        if self.ledger is not None:
            self.touched |= self.ledger.done(so).touched()     # its tokens processed: windows move on
            # requests finished inside update_from_output (or preempted by a reset) let go now: their
            # blocks are free in the pool already, and no schedule may follow (vLLM goes idle)
            d = self.ledger.finish(list(getattr(scheduler, "finished_req_ids", ()) or ())
                                   + list(getattr(scheduler, "reset_preempted_req_ids", ()) or ()))
            self.touched |= d.touched()
            self._forget(d.released)
            if self.recorder is not None and d.released:
                self._record("on_release", scheduler, d, self.ledger.steps)
        now = time.perf_counter()
        step_s = None if t0 is None else now - t0
        self.step += 1
        self.last_facts = self._facts(scheduler, step_s)
        self.since_check = 0
        if self.recorder is not None:
            self._record("on_update", scheduler, so, so_step if so_step is not None else self.step, step_s, outputs)
        if not scheduler.requests:                   # nobody waits: no clock of ours runs on
            self.progress.clear()
            self.progress_t.clear()
            self._sweep_when_idle(scheduler)

    def _record(self, method: str, *args) -> None:
        """A flight recorder call: its failure is one log line, never the checks'."""
        try:
            getattr(self.recorder, method)(*args)
        except Exception as e:
            self.rep.error("flight recorder", e)

    def _facts(self, scheduler, step_s) -> dict:
        """The step message's figures of the scheduler and the pool (ints read off vLLM's objects)."""
        running = len(scheduler.running)
        return {"step": self.step, "t": time.time(), "step_s": step_s,
                "num_free": scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks,
                "running": running, "waiting": len(scheduler.requests) - running}

    def _forget(self, released) -> None:
        """Every per-request structure of ours goes when the ledger releases the request, on whichever
        path (a finish or abort seen at schedule time, one inside update_from_output, a preemption)."""
        for rid in released:
            for g in range(len(self.rules)):
                self.crc.pop((rid, g), None)
            self.progress.pop(rid, None)
            self.progress_t.pop(rid, None)
            self.stall_said.discard(rid)

    # ---- forward progress (probes/progress.py) --------------------------------------------
    def _progress(self, scheduler, so) -> None:
        """Requests that are not running and have not been scheduled for `stall_after` steps while
        the pool holds what they need: `stalled` (error when nothing runs at all: a hang)."""
        step = self.ledger.steps
        for rid in getattr(so, "num_scheduled_tokens", None) or {}:
            self.progress[rid] = step
            self.progress_t.pop(rid, None)
        # a step with every seat or the whole token budget taken is a fair reason to wait: the clock
        # of every waiting request starts again after it
        seats = getattr(scheduler, "max_num_active_reqs", None) or getattr(scheduler, "max_num_running_reqs", None)
        budget = getattr(scheduler, "max_num_scheduled_tokens", None)
        if (seats is not None and len(scheduler.running) >= seats) or \
                (budget is not None and getattr(so, "total_num_scheduled_tokens", 0) >= budget):
            self.saturated_at = step
        if step % 8:
            return                                    # every 8th output: O(requests) is cheap then
        if getattr(getattr(scheduler, "pause_state", None), "name", "UNPAUSED") != "UNPAUSED":
            self.saturated_at = step                  # paused on purpose: nobody is owed admission
            return
        running = {r.request_id for r in scheduler.running}
        bs = int(scheduler.block_size)
        waiting = {}
        now = time.monotonic()
        for rid, r in list(scheduler.requests.items()):
            if rid in running or r.is_finished():
                continue
            if getattr(getattr(r, "status", None), "name", "WAITING") != "WAITING" \
                    and "PREEMPTED" not in r.status.name:
                continue                              # waiting for remote KV, a grammar, streamed input
            if now - self.progress_t.setdefault(rid, now) < self.s.stall_after_s:
                continue
            since = max(self.progress.setdefault(rid, step), self.saturated_at)
            waiting[rid] = (since, -(-(r.num_tokens - r.num_computed_tokens) // bs))
        # requests that left (an abort of one never scheduled leaves no ledger entry to release)
        for rid in [r for r in {**self.progress, **self.progress_t} if r not in scheduler.requests]:
            self.progress.pop(rid, None)
            self.progress_t.pop(rid, None)
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        found = []
        for rid, waited, need in stalled(step, waiting, free, self.s.stall_after):
            if rid in self.stall_said:
                continue
            self.stall_said.add(rid)
            hang = not running
            found.append(sanitizer.finding(
                sanitizer.PROBE_POOL, "stalled", "error" if hang else "warn",
                f"step {self.step}: request {rid} has waited {waited} steps unscheduled although the pool has "
                f"{free} free blocks and it needs {need}" + (" (nothing is running: the engine is hung)" if hang
                                                              else f" ({len(running)} requests running)"),
                self.step, rid, None, waited=waited, free_blocks=free, needs=need, running=len(running),
                waiting=len(waiting)))
        if len(self.stall_said) > 100_000:
            self.stall_said.clear()
        if found:
            self.rep.findings(found, key=lambda f: ("stalled", f["request_id"]))

    # ---- the idle sweep, off vLLM's step ----------------------------------------------------
    def _sweep_when_idle(self, scheduler) -> None:
        """The whole pool, once vLLM is idle: every block free, the snapshot and the prefix hashes for
        the workbench. Done on the plugin's own thread, so the step that went idle returns its last
        tokens without waiting for a walk over 100k blocks (~30 ms); kept only if vLLM stayed idle
        and took no step while it ran (a step would make it a mix of two pool states)."""
        self._idle_at = (scheduler, self.step)
        if self._sweeper is None:
            self._wake = threading.Event()
            self._sweeper = threading.Thread(target=self._sweep_loop, name="kvwb-plugin-sweep", daemon=True)
            self._sweeper.start()
        self._wake.set()

    def _sweep_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(0.05)                          # a burst that goes on at once needs no idle sweep
            scheduler, step = self._idle_at
            try:
                self.check(scheduler, None, True, deferred=step)
            except RuntimeError:                      # a step began mid-walk ("changed size during
                pass                                  # iteration"): that sweep is dropped, as above
            except Exception as e:
                self.rep.error("pool check (idle sweep)", e)

    # ---- the check --------------------------------------------------------------------------
    def check(self, scheduler, step_s, idle: bool, deferred: int | None = None) -> None:
        """The step's check (deferred=None): incremental, or a full sweep every full_every checks.
        deferred=step: the idle sweep of that step, dropped if vLLM has stepped since."""
        if deferred is not None and (self.step != deferred or scheduler.requests):
            return
        with self._check_lock:
            self._check(scheduler, step_s, idle, deferred)

    def _check(self, scheduler, step_s, idle: bool, deferred: int | None) -> None:
        t0 = time.perf_counter()
        # findings name the step whose schedule() left the state checked, as the ledger and the flight
        # recorder number them (the idle sweep: the last one)
        self.checked_at = self.scheduled
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        blocks = pool.blocks
        n = len(blocks)
        if self.ledger is None:
            self._new_ledger(scheduler)
        null = getattr(getattr(pool, "null_block", None), "block_id", None)
        pins = self._pins(scheduler, kvm)
        every = self.s.full_every
        full = deferred is not None or bool(every and self.checks % every == 0)
        if deferred is None:
            self.checks += 1
        arrays = ()
        extra: dict = {}
        if full:
            found, arrays, extra = self._sweep(scheduler, pool, blocks, n, null, pins, idle)
        else:
            # the blocks this step touched, and a rotating slice of the pool: the same rules as the full
            # sweep, a bounded number of blocks a step (the whole pool every n / sweep_slice steps)
            lo, hi = self._slice(n)
            idx = np.fromiter((b for b in self.touched if 0 <= b < n and b != null and not lo <= b < hi),
                              dtype=np.int64)
            ref = np.fromiter((blocks[b].ref_cnt for b in idx), dtype=np.int64, count=len(idx))
            inq = np.fromiter((in_queue(blocks[b]) for b in idx), dtype=bool, count=len(idx))
            if hi > lo:                               # the slice read once: its rules here, its snapshot sent
                ref_sl, inq_sl, hashed_sl = self._read_slice(blocks, lo, hi)
                sl = np.arange(lo, hi, dtype=np.int64)
                keep = sl != null if null is not None else np.ones(hi - lo, dtype=bool)
                idx, ref, inq = (np.concatenate([idx, sl[keep]]), np.concatenate([ref, ref_sl[keep]]),
                                 np.concatenate([inq, inq_sl[keep]]))
            expected = self.ledger.counts[idx] + pin_counts(pins, idx)
            found = sanitizer.touched_block_findings(self.checked_at, idx, ref, inq, expected, self.ledger.last_holder,
                                                     pins, self.ledger.optional[idx], self.ledger.who)
            if hi > lo:
                arrays, extra = self._slice_snapshot(blocks, lo, hi, ref_sl, inq_sl, hashed_sl)
        if deferred is not None:
            if self.step != deferred or scheduler.requests:
                return                                # vLLM stepped while we walked: not one pool state
        else:
            self.touched.clear()
        self.check_s += time.perf_counter() - t0
        # the step's own figures as update_from_output left them (on_update, on vLLM's thread); the idle
        # sweep's and the first step's read now
        facts = self.last_facts if deferred is None and self.last_facts is not None else self._facts(scheduler, step_s)
        t_send = time.perf_counter()
        self.rep.send(b"step", {
            **facts, "check_s": self.check_s, "num_blocks": n,
            "block_size": scheduler.block_size, "full": full, "idle_sweep": deferred is not None,
            "hits_checked": sum(p.hits_checked for p in self.prov.values()),
            "dropped": getattr(self.rep.pub, "dropped", 0),  # messages a full send queue dropped so far
            "process": multiprocessing.current_process().name, **extra}, arrays)
        self.check_s = time.perf_counter() - t_send        # the send counts too: in the next step's figure
        if found:
            # a leak is one condition per request (the sweep and the incremental check see it from
            # different blocks); the others per block, and a block freed while in use (ref_cnt 0 under a
            # reader) once more after a too-low count of it: the escalation that corrupts the next owner
            self.rep.findings(found, key=lambda f: (f["probe"], f["kind"], f["request_id"],
                                                    None if f["kind"] == "leak" else f["page"],
                                                    f["kind"] == "refcount" and f["evidence"].get("ref_cnt") == 0
                                                    and f["evidence"].get("mapped", 0) > 0))


def pin_counts(pins: dict, idx: np.ndarray) -> np.ndarray:
    """How many pins each of these blocks has (vectorised: a step checks ~500 blocks, pins are few)."""
    out = np.zeros(len(idx), dtype=np.int64)
    if pins and len(idx):
        keys = np.fromiter(pins.keys(), dtype=np.int64, count=len(pins))
        lens = np.fromiter((len(v) for v in pins.values()), dtype=np.int64, count=len(pins))
        order = np.argsort(keys)
        keys, lens = keys[order], lens[order]
        at = np.searchsorted(keys, idx).clip(0, len(keys) - 1)
        hit = keys[at] == idx
        out[hit] = lens[at[hit]]
    return out


# managers of a modelled family whose rules differ from their base's: R-SWA frees a middle gap,
# ring buffers reuse one block, HiSparse draws from its own host pool
UNMODELLED = ("RSWAManager", "CircularBufferManager", "HiSparseSourceManager", "HiSparseHotManager",
              "HiSparseResidentManager", "MambaManager", "CrossAttentionManager")


def group_rules(scheduler) -> tuple[list[GroupRule | None], str]:
    """Each KV cache group's rule, from its spec (window, chunk) and its manager's kind; None for a
    group the ledger does not model (Mamba and other state groups, R-SWA, ring buffers): its
    blocks count as pins from vLLM's own lists, and the status line says so."""
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or []
    mgrs = scheduler.kv_cache_manager.coordinator.single_type_managers
    rules, said = [], []
    for g, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        mro = [c.__name__ for c in type(mgrs[g]).__mro__] if g < len(mgrs) else ["?"]
        mgr = mro[0]          # a platform's subclass of a manager follows its base's rule, unless named here
        if mgr in UNMODELLED or not {"FullAttentionManager", "SlidingWindowManager",
                                     "ChunkedLocalAttentionManager"} & set(mro):
            rule, how = None, f"{mgr}: not modelled, its own lists count as pins, no provenance"
        elif "SlidingWindowManager" in mro:
            rule = GroupRule("sliding", int(spec.sliding_window), int(getattr(spec, "extra_retained_tokens", 0) or 0))
            how = f"window {rule.window} tokens: blocks behind it may be freed mid-request"
        elif "ChunkedLocalAttentionManager" in mro:
            rule = GroupRule("chunked", int(spec.attention_chunk_size))
            how = f"chunks of {rule.window} tokens: blocks before the current chunk may be freed"
        else:
            rule, how = GroupRule(), "every block until the request ends"
        rules.append(rule)
        said.append(f"group {g} {type(spec).__name__} (block {spec.block_size}; {how})")
    return rules, f"{len(groups)} KV cache group(s): " + "; ".join(said) if groups else ""
