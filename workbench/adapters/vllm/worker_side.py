"""The worker side of the plugin: the attention metadata the kernels read, checked against our ledger.

Hooked where every model runner's metadata passes (issue 26): `AttentionMetadataBuilder.build`
on the base class and every subclass, including those defined later (vllm-ascend's builders,
which its NPUModelRunner calls directly, v1 and v2). The runner's `execute_model` (V1 GPU/CPU
runner, V2 runner, NPUModelRunner: each class that defines it) hands us the step's
SchedulerOutput, which goes into the worker's ledger; the V2 runner's `prepare_inputs` hands
us the row order of its InputBatch (the V1 runners keep theirs in `input_batch.req_ids`).

Rows past the batch's real requests (CUDA-graph padding) and tokens past its real tokens are
not read. A step whose rows cannot be matched to requests (a micro-batch slice) is skipped,
and a check that stays skipped becomes a `check-inactive` warning.
"""
from __future__ import annotations

import multiprocessing
import time

import numpy as np

from . import faults, sanitizer
from . import status as st
from .host_copy import HostCopies
from .ledger import BlockLedger

CHECKED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")


def _np(t, n=None):
    a = t.detach().to("cpu") if hasattr(t, "detach") else t
    a = np.asarray(a)
    return a if n is None else a[:n]


def kernel_pages(pages: list[int], ratio: int, stride: int) -> list[int]:
    """A request's manager blocks as the kernel blocks the kernel reads (vectorised)."""
    if ratio == 1:
        return list(pages)
    a = np.asarray(pages, dtype=np.int64)[:, None] * stride + np.arange(ratio, dtype=np.int64)[None, :]
    return a.reshape(-1).tolist()


def kernel_stride(runner, ratio: int, owns) -> int:
    """Kernel block j of manager block b is b * stride + j: the packed-cache stride of the attention
    group `owns(group)` picks, where it set one, else the kernel blocks per manager block."""
    for groups in getattr(runner, "attn_groups", None) or ():
        for ag in groups:
            if owns(ag):
                return int(getattr(ag, "kernel_block_stride", 0) or ratio)
    return ratio


class MetadataWatch:
    def __init__(self, rep, settings):
        self.rep, self.s = rep, settings
        self.switch = faults.FaultSwitch(settings.fault_file, on_error=st.problem)
        self.ledger = BlockLedger()
        self.last_so = None              # the SchedulerOutput applied last (nested execute_model calls)
        self.runner = None
        self.req_ids = None              # the V2 runner's row order for this execution
        self.executions = 0
        self.done_groups: set[int] = set()
        self.last_cm = None              # this execution's last metadata (update_block_table reuses it)
        self.last_records: list = []     # the last check's StepRecords (two when kernel blocks split a block)
        self.since_check = 0
        self.checks = 0
        self.group_checks: dict[int, int] = {}     # KV cache group -> metadata checks run on it
        self.check_s = 0.0
        self._cost_sent = time.monotonic()
        self.copies = HostCopies()       # device tensors to the host without a stream sync

    # ---- the hooks' callbacks -------------------------------------------------------------
    def on_runner_ready(self, runner) -> None:
        cls = type(runner)
        v2 = ".gpu.model_runner" in (cls.__module__ + ".") or ".v2." in cls.__module__
        path = f"{cls.__name__} ({'V2' if v2 else 'V1'} model runner, {cls.__module__})"
        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
        left = [f"group {i} ({type(g.kv_cache_spec).__name__}: not checked, no block table of this kind)"
                for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ not in CHECKED_SPECS]
        ok = len(groups) - len(left)
        self.rep.status(st.CheckStatus(st.CHECK_METADATA, ok > 0 or not groups, "AttentionMetadataBuilder.build",
                                       path, "; ".join(left) if ok else "no KV cache group it can check"))

    def on_execute(self, runner, so, dummy: bool) -> None:
        if self.copies.pending:
            self.judge_landed()                         # last execution's device copies, landed by now
        self.runner, self.req_ids = (None if dummy else runner), None   # a dummy run's builds are not a batch
        if so is None or dummy or so is self.last_so:
            return
        self.last_so = so
        self.ledger.apply(so)
        self.executions += 1
        self.done_groups = set()
        self.last_cm = None
        if getattr(so, "total_num_scheduled_tokens", 0):
            self.since_check += 1
            if self.since_check >= self.s.inactive_after:
                self.rep.inactive(sanitizer.PROBE_METADATA, st.CHECK_METADATA, self.since_check,
                                  f"no attention metadata reached AttentionMetadataBuilder.build with rows the "
                                  f"plugin can match, on {type(runner).__name__}")

    def on_inputs(self, input_batch) -> None:
        ids = getattr(input_batch, "req_ids", None)
        if ids is not None:
            self.req_ids = list(ids)

    def on_build(self, builder, cm):
        """The metadata the kernel will get (a fault may change it), checked; returns it."""
        try:
            cm = faults.metadata(self.switch, cm, builder.kv_cache_spec.block_size)
        except Exception as e:
            self.rep.error("fault seam (metadata)", e)
        if self.runner is None or self.last_so is None:
            return cm                                   # a warm-up or capture build: no real batch
        self.last_cm = cm
        try:
            self.check(builder, cm)
        except Exception as e:
            self.rep.error("metadata check", e)
        return cm

    def on_update_table(self, builder, block_table, slot_mapping) -> None:
        """vLLM's shortcut for a further KV cache group of the same spec and builder (FlashAttention on
        CUDA): the first group's metadata with this group's block table and slot mapping, no build()."""
        cm = self.last_cm
        if self.runner is None or cm is None:
            return
        try:
            from dataclasses import replace
            self.check(builder, replace(cm, block_table_tensor=block_table, slot_mapping=slot_mapping))
        except Exception as e:
            self.rep.error("metadata check (update_block_table)", e)

    # ---- the check --------------------------------------------------------------------------
    def _group(self, builder) -> int | None:
        groups = getattr(getattr(self.runner, "kv_cache_config", None), "kv_cache_groups", None) or []
        names = getattr(builder, "layer_names", None) or []
        for i, g in enumerate(groups):
            if names and names[0] in g.layer_names:
                return i
        return 0 if len(groups) == 1 else None

    def check(self, builder, cm) -> None:
        if self.copies.pending:
            self.judge_landed()
        g = self._group(builder)
        if g is None or g in self.done_groups:
            return
        groups = self.runner.kv_cache_config.kv_cache_groups
        spec_name = type(groups[g].kv_cache_spec).__name__
        if spec_name not in CHECKED_SPECS:
            return
        req_ids = self.req_ids if self.req_ids is not None else list(self.runner.input_batch.req_ids)
        n = len(req_ids)
        qsl = _np(cm.query_start_loc_cpu)
        if n == 0 or len(qsl) < n + 1 or int(qsl[0]) != 0 or cm.num_reqs < n:
            return                                       # not this batch's rows (a micro-batch slice)
        t0 = time.perf_counter()
        self.done_groups.add(g)
        entries = [self.ledger.reqs.get(r) for r in req_ids]
        if any(e is None for e in entries):
            missing = [r for r, e in zip(req_ids, entries) if e is None]
            self.rep.findings([sanitizer.finding(
                sanitizer.PROBE_METADATA, "unknown-request", "error",
                f"execution {self.executions}: rows for requests the scheduler never sent: {missing[:4]}",
                self.executions, missing[0])], key=lambda f: ("unknown", f["request_id"]))
            return
        kernel_bs = int(builder.kv_cache_spec.block_size)
        bs = int(groups[g].kv_cache_spec.block_size)
        if kernel_bs != bs and (kernel_bs > bs or bs % kernel_bs):
            return        # not a split vLLM makes: nothing to map the ledger's blocks by
        if getattr(self.last_so, "scheduled_spec_decode_tokens", None) and \
                getattr(self.runner, "use_async_scheduling", False):
            return        # async + spec decode: the runner corrects positions on the device from accepted drafts
        pages = [e.groups[g] if g < len(e.groups) else [] for e in entries]
        starts = [e.computed for e in entries]
        q = [e.scheduled for e in entries]
        t = int(qsl[n])                                  # real tokens; padding after them is not read
        kv_cfg = getattr(self.runner, "kv_cache_config", None)
        num_blocks = getattr(kv_cfg, "num_blocks", None)
        stride = None
        if kernel_bs != bs:
            # the kernel reads kernel blocks: manager block b is b * stride + j, j < bs / kernel_bs
            # (AttentionGroup.map_to_kernel_block_table); the K/V write keeps the manager's slots
            stride = kernel_stride(self.runner, bs // kernel_bs,
                                   lambda ag: builder in (getattr(ag, "metadata_builders", None) or ()))
        # the device tensors the kernels read, copied without blocking the stream (host_copy.py):
        # judged now on the host (the CPU build), at a later execution once a device's copies land
        snap = self.copies.take(
            {"seq_lens": (cm.seq_lens, n), "block_table": (cm.block_table_tensor, n),
             "slot_mapping": (cm.slot_mapping, t),
             "positions": None if getattr(cm, "positions", None) is None else (cm.positions, t)},
            payload=(self.executions, g, list(req_ids), starts, q, pages, bs, kernel_bs, num_blocks, stride,
                     np.array(qsl[:n + 1], copy=True)))
        self.since_check = 0
        self.check_s += time.perf_counter() - t0
        if snap.on_host:                                 # nothing deferred: judged now
            self._judge(snap)

    def judge_landed(self) -> None:
        """The deferred checks whose copies have landed (a device's), oldest first."""
        for p in self.copies.completed():
            try:
                self._judge(p)
            finally:
                self.copies.release(p)

    def _judge(self, snap) -> None:
        t0 = time.perf_counter()
        execution, g, req_ids, starts, q, pages, bs, kernel_bs, num_blocks, stride, qsl = snap.payload
        a = snap.arrays()
        common = dict(query_start_loc=qsl, seq_lens=a["seq_lens"], positions=a["positions"])
        # the step as a StepRecord (workbench/step_record.py), checked by the probes' own invariants
        if kernel_bs == bs:
            records = [sanitizer.vllm_record(execution, req_ids, starts, q, pages, bs, num_blocks,
                                             block_table=a["block_table"], slot_mapping=a["slot_mapping"],
                                             **common)]
        else:
            kpages = [kernel_pages(p, bs // kernel_bs, stride) for p in pages]
            records = [sanitizer.vllm_record(execution, req_ids, starts, q, kpages, kernel_bs,
                                             None if num_blocks is None else num_blocks * stride,
                                             block_table=a["block_table"]),
                       sanitizer.vllm_record(execution, req_ids, starts, q, pages, bs, num_blocks,
                                             slot_mapping=a["slot_mapping"], **common)]
        found = [f for r in records for f in sanitizer.record_findings(r)]
        self.last_records = [r.freeze() for r in records]   # kept: their arrays are copies already
        self.checks += 1
        self.group_checks[g] = self.group_checks.get(g, 0) + 1
        self.check_s += time.perf_counter() - t0
        now = time.monotonic()
        if now - self._cost_sent >= 1.0 or self.checks % 16 == 0:   # also the worker's heartbeat
            self._cost_sent = now
            self.rep.send(b"cost", {"process": multiprocessing.current_process().name, "checks": self.checks,
                                    "check_s": self.check_s, "executions": self.executions,
                                    "groups": {str(k): v for k, v in self.group_checks.items()}})
        if found:
            for f in found:
                f["evidence"]["kv_cache_group"] = g
            self.rep.findings(found, key=lambda f: (f["probe"], f["kind"], f["evidence"].get("copy"),
                                                    f["request_id"]))
