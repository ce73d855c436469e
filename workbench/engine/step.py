"""One engine step, vLLM's EngineCore.step in our terms:

    drain the inbox -> Scheduler.schedule -> ModelRunner.prepare -> StepRecord
    -> ModelRunner.execute -> Scheduler.update_from_output -> outputs and events

The step runs on the thread that drives the engine; everything it mutates it mutates here.
Events are emitted only for types someone subscribes to (bus.wants). The StepRecord
(workbench/step_record.py) exists from the moment the batch is packed, before the forward,
so a probe reading it during the forward and one reading it after see the same record.
"""
from __future__ import annotations

import threading
import time

from ..events import BatchPacked, BlockTableBound, EngineIdle, RequestArrived, StepFinished, now_ns
from ..events import RequestRejected as RequestRejectedEvent
from ..step_record import StepRecord
from . import lifecycle
from .outputs import RequestOutput


def record_of(step: int, sched, batch, num_pages: int | None) -> StepRecord:
    """Our engine's StepRecord for a packed batch: the reference from each sequence's own state
    (computed tokens, page list, token ids) and the scheduler's decision, in the batch's row order;
    the copies are the batch's tensors and host arrays, untouched until a probe reads them."""
    seqs = batch.seqs
    chunk = {id(s): n for s, n in sched.scheduled} if sched is not None else {}
    scheduled, unscheduled = [], []
    for i, s in enumerate(seqs):
        n = chunk.pop(id(s), None)
        if n is None:                 # not scheduled: the batch's own length is all there is
            n = int(batch.query_lens_np[i]) if i < len(batch.query_lens_np) else 0
            if sched is not None:
                unscheduled.append(i)
        scheduled.append(n)
    return StepRecord(
        step, "engine", batch.page_size, num_pages,
        request_ids=[s.request_id for s in seqs],
        computed=[s.num_computed_tokens for s in seqs], scheduled=scheduled,
        pages=[list(s.pages) for s in seqs], token_ids=[s.token_ids for s in seqs],
        copies={"positions": ("positions", batch.positions),
                "slot_mapping": ("slot_mapping", batch.slot_mapping),
                "input_ids": ("input_ids", batch.input_ids),
                "query_lens_np": ("q", batch.query_lens_np),
                "diff(cu_seqlens_q_np)": ("diff_q", batch.cu_seqlens_q_np),
                "cu_seqlens_q_np": ("cu_q", batch.cu_seqlens_q_np),
                "cu_seqlens_q": ("cu_q", batch.cu_seqlens_q),
                "context_lens_np": ("ctx", batch.context_lens_np),
                "context_lens": ("ctx", batch.context_lens),
                "cu_seqlens_k": ("cu_k", batch.cu_seqlens_k),
                "block_tables": ("block_table", batch.block_tables)},
        unscheduled=unscheduled, missing=list(chunk.values()), batch=batch, schedule=sched)


def run_step(eng) -> list[RequestOutput]:
    t0 = time.perf_counter_ns()
    eng.step_started_ns, eng.step_thread_id = t0, threading.get_ident()
    eng.step_count += 1
    bus = eng.bus
    outputs = drain_inbox(eng)
    free_before = eng.pool.num_free
    with eng.lock:
        sched = eng.scheduler.schedule()
    if not sched.scheduled:
        if sched.preempted:          # a step that only preempted: its preemptions are still told
            lifecycle.emit_schedule(bus, eng.step_count, now_ns(), sched)
        if eng.scheduler.waiting and not eng.scheduler.running:
            head = eng.scheduler.waiting[0]
            raise RuntimeError(f"scheduler stalled: request {head.request_id} ({head.num_tokens} tokens) cannot be "
                               f"admitted into an idle pool of {eng.pool.num_free}/{eng.num_pages} free pages")
        eng._publish_stats()
        note_idle(eng)
        return outputs
    eng._idle = False
    lifecycle.emit_schedule(bus, eng.step_count, now_ns(), sched)
    t1 = time.perf_counter_ns()
    with eng.lock:
        batch = eng.runner.prepare(sched)
    rec = eng.step_record = record_of(eng.step_count, sched, batch, eng.num_pages)
    if bus.wants(BlockTableBound):
        bt = eng.builder.block_tables
        bus.emit(BlockTableBound(eng.step_count, now_ns(), bt.version, bt.checksum, *bt.shape))
    if bus.wants(BatchPacked):
        lifecycle.emit_packed(bus, eng.step_count, now_ns(), sched, batch)
    t2 = time.perf_counter_ns()
    out = eng.runner.execute(sched, batch)
    t3 = time.perf_counter_ns()
    with eng.lock:
        produced, finished = eng.scheduler.update_from_output(sched, out, time.perf_counter(), eng.eos_token_ids)
    for seq in finished:
        eng.requests.forget(seq.request_id)
        lifecycle.emit_finished(bus, eng.step_count, now_ns(), seq)
    outputs.extend(map(eng._output, produced))
    t4 = time.perf_counter_ns()
    rec.timings = {"schedule": t1 - t0, "prepare": t2 - t1, "execute": t3 - t2, "update": t4 - t3}
    rec.pool = {"free_before": free_before, "free_after": eng.pool.num_free,
                "cached_free_after": eng.pool.num_cached_free}
    if bus.wants(StepFinished):
        kv_read, kv_written = eng.step_bytes(batch)
        lifecycle.emit_step(bus, eng.step_count, now_ns(), time.perf_counter_ns() - t0, sched, eng.pool,
                            eng.scheduler, eng.weight_bytes, kv_read, kv_written)
    eng._publish_stats()
    note_idle(eng)
    return outputs


def drain_inbox(eng) -> list[RequestOutput]:
    """Move what add_request / abort queued into the scheduler; abort outputs come back at once."""
    bus = eng.bus
    for rid, n, why in eng.intake.drain_notices():
        if bus.wants(RequestRejectedEvent):
            bus.emit(RequestRejectedEvent(eng.step_count, now_ns(), rid, n, why))
    aborted = []
    for kind, item in eng.intake.drain():
        if kind == "add":
            eng.requests.enter(item)
            eng.scheduler.add(item)
            if bus.wants(RequestArrived):
                bus.emit(RequestArrived(eng.step_count, now_ns(), item.request_id, item.num_prompt_tokens,
                                        item.params.max_tokens))
        else:
            seq = eng.requests.take(item)
            if seq is not None:
                aborted.append(seq)
    if not aborted:
        return []
    with eng.lock:                         # frees their pages: the step's lock, in both modes, once
        for seq in aborted:
            eng.scheduler.finish(seq, "abort")
    now = time.perf_counter()
    eng._publish_stats()                   # sharded: stats() shows the aborts before the step ends
    for seq in aborted:
        seq.finish_time = now
        lifecycle.emit_finished(bus, eng.step_count, now_ns(), seq)
    return [eng._output(seq) for seq in aborted]


def note_idle(eng) -> None:
    """Emit EngineIdle once, when the last request has left (finished, aborted or rejected)."""
    if eng._idle or eng.scheduler.has_unfinished() or not eng.intake.empty():
        return
    eng._idle = True
    if eng.bus.wants(EngineIdle):
        eng.bus.emit(EngineIdle(eng.step_count, now_ns(), eng.pool.num_used, eng.pool.num_cached_free))
