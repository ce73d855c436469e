"""The flight recorder inside vLLM: on whenever the plugin is, in the engine core process.

Everything comes from what the plugin already sees at `Scheduler.schedule` and
`Scheduler.update_from_output` and what it returns (no further hook, nothing read from the workers):

  request   a new request's id, the step it was first scheduled, arrival (seconds since the
            recording began, from vLLM's own arrival_time), prompt token ids (PAGEDKV_RECORD_PRIVACY:
            its length and per-block digests), max tokens and sampling
  ev        the pool in the workbench's event schema, so TimeTravel rebuilds it: PagesShared for a
            new or resumed request's prefix-cache hit blocks, PagesAllocated for blocks newly mapped,
            PagesFreed when a finished or preempted request lets go (pages whose ref_cnt is 0 then,
            those that keep their prefix hash, those others still hold), StepFinished per step
            (scheduled tokens, running, waiting, blocks in use, preemptions, step time)
  blocks    a request's block ids per KV cache group as they cross to the workers (whole lists for a
            new or resumed request, appended ids after): Recording.blocks_of() replays its life
  step      per step, the tokens scheduled per request and the preempted ids
  tokens    per step, the new token ids per request from update_from_output's outputs (privacy:
            counts) and the ids that finished: what a divergence triage compares against
  finding   the plugin's findings on this process; one >= error freezes a repro bundle, and so do
            SIGUSR1 and SIGTERM (then vLLM's own handler runs) and `kvwb dump DIR`. Bundles are made
            on the recorder's own thread: a signal handler only records that one was asked for
            (one bundle per burst of signals), a finding only queues it

The recorded pool follows the SchedulerOutputs: blocks a sliding window frees mid-request are not
in it (vLLM does not tell the workers either). One directory per engine core process,
`vllm-<pid>-<time>` under PAGEDKV_RECORD_DIR; the path is logged at start-up.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections import deque

from workbench.recorder.budget import enforce, trim_bundles
from workbench.recorder.bundle import freeze
from workbench.recorder.ring import SegmentRing, prompt_fields

from . import status as st
from .ledger import grown_rows, whole_lists


class VllmRecorder:
    def __init__(self, settings):
        self.s = settings
        self.ring: SegmentRing | None = None
        self.seen: set[str] = set()
        self.bundles: list[str] = []
        self.preemptions = 0
        self._t0_wall = time.time()
        self._frozen_kinds: set = set()
        self._reasons: deque = deque()            # appended by signal handlers and findings: no lock taken
        self._pipe: tuple[int, int] | None = None  # the self-pipe a handler writes one byte to
        self._freezer: threading.Thread | None = None
        self._term_state = "none"                 # none | asked | frozen | chained
        self.quiet_s, self.burst_s = 0.25, 2.0
        self._freeze_lock = threading.Lock()     # one freeze (and its budget) at a time: the freezer's or inline

    # ---- start -------------------------------------------------------------------------------
    def start(self, scheduler) -> None:
        root = os.path.join(self.s.record_dir, f"vllm-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}")
        cfg = getattr(scheduler, "vllm_config", None)
        sc = getattr(cfg, "scheduler_config", None)
        groups = scheduler.kv_cache_config.kv_cache_groups
        try:
            import vllm
            version = getattr(vllm, "__version__", "?")
        except Exception:
            version = "?"
        header = {"writer": "vllm plugin", "vllm": version, "model": str(getattr(getattr(cfg, "model_config", None),
                                                                                 "model", "?")),
                  "block_size": int(scheduler.block_size),
                  "num_blocks": len(scheduler.kv_cache_manager.block_pool.blocks),
                  "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in groups],
                  "max_num_seqs": getattr(sc, "max_num_seqs", None),
                  "max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
                  "enable_prefix_caching": bool(getattr(getattr(cfg, "cache_config", None), "enable_prefix_caching",
                                                        True)),
                  "privacy": self.s.record_privacy, "pid": os.getpid()}
        self.ring = SegmentRing(root, header, max_bytes=self.s.record_max_mb * 2**20)
        self._budget()                                # earlier starts' recordings within the disk budget
        st.log.info("PagedKV Workbench flight recorder: %s (cap %d MB; kvwb dump %s freezes a bundle)", root,
                    self.s.record_max_mb, root)
        self._signals()

    def _signals(self) -> None:
        """SIGUSR1 and SIGTERM ask for a bundle; they never make one. A handler only appends the
        signal's name to a deque and writes one byte to a non-blocking self-pipe (no lock, no file):
        the recorder's own thread (_freezer) freezes, once per burst. SIGTERM's bundle is frozen
        before the process goes: the freezer re-sends SIGTERM once it is on disk, and the handler then
        chains to what was installed before us (vLLM's handler, or the default: exit). A second
        SIGTERM while the first is being frozen chains at once (a supervisor escalating)."""
        self._start_freezer()
        if threading.current_thread() is not threading.main_thread():
            return                                   # handlers can be set from the main thread only
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                prev = signal.getsignal(sig)

                def handler(signum, frame, _prev=prev):
                    if signum == signal.SIGTERM and (self._term_state != "none" or self._freezer is None):
                        self._term_state = "chained"
                        _chain(_prev, signum, frame)
                        return
                    if signum == signal.SIGTERM:
                        self._term_state = "asked"
                    self._reasons.append(signal.Signals(signum).name)
                    self._poke()
                signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _start_freezer(self) -> None:
        if self._freezer is not None:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._freezer = threading.Thread(target=self._freeze_loop, name="kvwb-recorder-freezer", daemon=True)
        self._freezer.start()

    def _poke(self) -> None:
        try:
            os.write(self._pipe[1], b"!")
        except OSError:                              # the pipe is full: a freeze is already asked for
            pass

    def _drain(self) -> None:
        r = self._pipe[0]
        os.set_blocking(r, False)
        try:
            while os.read(r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        finally:
            os.set_blocking(r, True)

    def request_freeze(self, reason: str) -> None:
        """A bundle, frozen on the recorder's thread (a finding: never on vLLM's busy loop)."""
        if self._freezer is None:
            self.freeze(reason)
            return
        self._reasons.append(reason)
        self._poke()

    def _freeze_loop(self) -> None:
        """One bundle per burst: after the first request, wait until none came for `quiet_s` (at most
        `burst_s` in all; SIGTERM does not wait), freeze once for every reason asked, and drop what
        was asked while it froze (it is in that bundle)."""
        r = self._pipe[0]
        while True:
            try:
                if not os.read(r, 4096):
                    return
            except OSError:
                return
            t0 = time.monotonic()
            while self._term_state != "asked" and time.monotonic() - t0 < self.burst_s:
                readable, _, _ = select.select([r], [], [], self.quiet_s)
                if not readable:
                    break                                # quiet: the burst is over
                self._drain()
            reasons = []
            while self._reasons:
                x = self._reasons.popleft()
                if x not in reasons:
                    reasons.append(x)
            try:
                self.freeze("+".join(reasons) or "signal")
            except Exception as e:                       # never let the thread die: the next ask must work
                st.problem(f"flight recorder: freeze failed: {type(e).__name__}: {e}")
            self._drain()
            self._reasons.clear()
            if self._term_state == "asked":
                self._term_state = "frozen"
                os.kill(os.getpid(), signal.SIGTERM)     # the handler now chains to vLLM's own

    # ---- the step ----------------------------------------------------------------------------
    def on_schedule(self, scheduler, so, delta, step: int) -> None:
        """delta: the ledger's Delta for this output (who let go of what, which blocks nobody holds)."""
        w, wp = self.ring.write, self.ring.write_plain      # wp: the records of ints and strings, every step
        pool = scheduler.kv_cache_manager.block_pool
        null = getattr(getattr(pool, "null_block", None), "block_id", None)
        t_ns = time.time_ns()
        self.on_release(scheduler, delta, step)
        bs = [int(g.kv_cache_spec.block_size) for g in scheduler.kv_cache_config.kv_cache_groups]
        for rid, new, resumed in grown_rows(so):     # only the rows that got blocks (few in a decode step)
            if not resumed:
                pages = [b for ids in new for b in ids if b != null]
                if pages:
                    wp({"k": "ev", "e": "PagesAllocated", "step": step, "t_ns": t_ns, "pages": pages,
                        "generations": [], "request_id": rid})
                    wp({"k": "blocks", "step": step, "request_id": rid, "groups": [list(ids) for ids in new],
                        "replace": False})
        for rid, groups, computed in whole_lists(so):
            hits, new = [], []
            for g, ids in enumerate(groups or ()):
                k = computed // bs[g] if g < len(bs) else 0
                hits += [b for b in ids[:k] if b != null]
                new += [b for b in ids[k:] if b != null]
            if hits:
                w({"k": "ev", "e": "PagesShared", "step": step, "t_ns": t_ns, "pages": hits, "request_id": rid})
            if new:
                w({"k": "ev", "e": "PagesAllocated", "step": step, "t_ns": t_ns, "pages": new, "generations": [],
                   "request_id": rid})
            # the request's own block list per KV cache group, whole (null blocks included, as vLLM has it)
            w({"k": "blocks", "step": step, "request_id": rid, "groups": [list(ids) for ids in groups or ()],
               "replace": True, "computed": computed})
            if rid not in self.seen:
                self.seen.add(rid)
                self._request(scheduler, rid, step)
        self.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
        wp({"k": "step", "step": step, "scheduled": dict(getattr(so, "num_scheduled_tokens", None) or {}),
            "preempted": sorted(getattr(so, "preempted_req_ids", None) or ())})

    def on_release(self, scheduler, delta, step: int) -> None:
        """Requests that let go of their blocks (finished, aborted, preempted): the ledger says which
        blocks nobody holds any more, the pool which of those keep their prefix hash."""
        blks = scheduler.kv_cache_manager.block_pool.blocks
        t_ns = time.time_ns()
        for rid, blocks in delta.released.items():
            gone = [b for b in blocks if b in delta.freed]
            self.ring.write({"k": "ev", "e": "PagesFreed", "step": step, "t_ns": t_ns, "pages": gone,
                             "request_id": rid,
                             "cached": [b for b in gone if 0 <= b < len(blks) and blks[b].block_hash is not None],
                             "still_shared": [b for b in blocks if b not in delta.freed]})

    def _request(self, scheduler, rid: str, step: int) -> None:
        req = scheduler.requests.get(rid)
        if req is None:
            return
        sp = getattr(req, "sampling_params", None)
        ids = list(getattr(req, "prompt_token_ids", None) or ())
        rec = {"k": "request", "id": rid, "step": step,
               "arrival_s": round(max(float(getattr(req, "arrival_time", self._t0_wall)) - self._t0_wall, 0.0), 6),
               "output_len": getattr(sp, "max_tokens", None),
               "sampling": {k: getattr(sp, k) for k in ("temperature", "top_p", "top_k", "ignore_eos", "seed")
                            if sp is not None and hasattr(sp, k)}}
        rec.update(prompt_fields(ids, int(scheduler.block_size), self.s.record_privacy))
        self.ring.write(rec)
        if len(self.seen) > 1_000_000:
            self.seen.clear()

    def on_update(self, scheduler, so, step: int, step_s: float | None, outputs=None) -> None:
        """step: the output's own step (engine_side keeps it from schedule time); outputs: what
        update_from_output returned, whose new tokens go in a `tokens` record (with privacy, counts)."""
        self._tokens(outputs, step)
        pool = scheduler.kv_cache_manager.block_pool
        n = len(pool.blocks)
        running = len(scheduler.running)
        sched = getattr(so, "num_scheduled_tokens", None) or {}
        self.ring.write_plain({"k": "ev", "e": "StepFinished", "step": step, "t_ns": time.time_ns(),
                               "duration_ns": int((step_s or 0.0) * 1e9), "num_tokens": int(sum(sched.values())),
                               "num_seqs": len(sched), "num_prefill_tokens": 0, "num_decode_tokens": 0,
                               "bytes_weights": 0, "bytes_kv_read": 0, "bytes_kv_written": 0,
                               "pages_used": n - pool.get_num_free_blocks(), "pages_cached": 0,
                               "num_running": running, "num_waiting": len(scheduler.requests) - running,
                               "num_preemptions": self.preemptions})
        self.ring.flush()

    def _tokens(self, outputs, step: int) -> None:
        out, done = {}, []
        privacy = self.s.record_privacy
        for eco in (outputs or {}).values():
            for o in getattr(eco, "outputs", None) or ():
                new = o.new_token_ids                  # vLLM's own list, serialised as it is (not kept)
                if new:
                    out[o.request_id] = len(new) if privacy else new
                if o.finish_reason is not None:
                    done.append(o.request_id)
        if out or done:
            self.ring.write_plain({"k": "tokens", "step": step, "out": out, "finished": done})

    # ---- findings and dumps ------------------------------------------------------------------
    def note_finding(self, f: dict) -> None:
        if self.ring is None:
            return
        self.ring.write({"k": "finding", **{k: f.get(k) for k in ("probe", "severity", "kind", "step", "request_id",
                                                                  "page", "message")}})
        if f.get("severity") == "error" and f.get("kind") not in self._frozen_kinds:
            self._frozen_kinds.add(f.get("kind"))    # one bundle per kind: a storm of one bug is one incident
            self.request_freeze(f"finding-{f.get('kind')}")   # on the recorder's thread, off the busy loop

    def _budget(self) -> None:
        try:
            t = enforce(self.s.record_dir, current=self.ring.root, keep_runs=self.s.record_keep,
                        keep_bytes=self.s.record_keep_mb * 2**20, keep_bundles=self.s.record_bundles)
        except Exception as e:                       # the budget never stops the recorder
            st.problem(f"flight recorder: disk budget not applied ({type(e).__name__}: {e})")
            return
        if t.runs or t.bundles:
            st.log.info("PagedKV Workbench flight recorder: disk budget removed %d earlier recording(s), %d "
                        "bundle(s), %.1f MB", len(t.runs), len(t.bundles), t.freed_bytes / 2**20)

    def freeze(self, reason: str) -> str | None:
        if self.ring is None:
            return None
        with self._freeze_lock:
            # Room first: this run's oldest bundles beyond the budget less one go before the new one appears
            # (a bundle appears whole, by a rename). So the run never holds more than its budget, even where the
            # process ends between the freeze and the budget: the freezer is a daemon thread, and a burst of
            # SIGUSR1 at the very end left a third bundle of two allowed (the vLLM soak test, once). The price:
            # a freeze that then fails (a full disk, which the room may be what it needed) has cost the oldest.
            try:
                trim_bundles(self.ring.root, max(0, self.s.record_bundles - 1))
            except Exception as e:                   # the budget never stops the recorder
                st.problem(f"flight recorder: disk budget not applied ({type(e).__name__}: {e})")
            try:
                path = str(freeze(self.ring, reason))
            except OSError as e:
                st.problem(f"flight recorder: could not freeze a bundle ({e})")
                return None
            self._budget()                           # the oldest bundles beyond the budget go, every run's
        self.bundles.append(path)
        st.log.warning("PagedKV Workbench: repro bundle frozen (%s): %s", reason, path)
        return path

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


def _chain(prev, signum, frame) -> None:
    """What was installed before the recorder's handler: call it, or do the default (exit on SIGTERM)."""
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL and signum == signal.SIGTERM:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
