"""Submission: Engine.add_request and Engine.abort, callable from any thread.

They validate (intake.py), then only push onto the inbox, under the lock a stream takes for its
own requests: "global", the step's page-table lock, as every stream's submission went in
production (field note 6: it waits for the step's critical sections and the step waits for it);
"sharded", the request's shard lock only (table_locks.py). The engine thread applies the inbox at
the start of its next step (step.py drain_inbox).
"""
from __future__ import annotations

from typing import Any

from ..events import RequestSubmitted, now_ns
from . import lifecycle
from .outputs import RequestRejected
from .sequence import SamplingParams, Sequence


def add_request(eng, prompt: Any, params: SamplingParams | None, request_id: Any) -> int:
    params = params or SamplingParams()
    try:
        ids = eng.intake.prompt_ids(prompt)
        eng.validate_prompt(ids)
        if params.prompt_logprobs and params.prompt_logprobs_from >= len(ids):
            raise RequestRejected(f"prompt_logprobs_from={params.prompt_logprobs_from} leaves no prompt token to "
                                  f"score in a prompt of {len(ids)} tokens")
    except RequestRejected as e:
        eng.intake.reject(request_id, prompt, str(e))     # reported as an event by the engine thread
        raise
    rid = eng.intake.new_id()
    seq = Sequence(rid, ids, params, user_request_id=request_id,
                   max_len=lifecycle.max_len(len(ids), params.max_tokens, eng.max_model_len, eng.num_pages,
                                             eng.config.page_size))
    lock = eng.table_lock(rid)
    lock.acquire(site="engine.py add_request")
    try:
        eng.locks.count_arrival()             # sharded: the snapshot counts it at once
        eng.intake.add(seq)
    finally:
        lock.release()
    # On the caller's thread, before add_request returns, and after the put: whoever hears of the
    # request can find it queued (the request_lifecycle probe's accounting relies on that order).
    if eng.bus.wants(RequestSubmitted):
        eng.bus.emit(RequestSubmitted(eng.step_count, now_ns(), rid, request_id, ids, params, seq.arrival_time))
    return rid


def abort(eng, request_id: Any) -> None:
    lock = eng.table_lock(request_id)
    lock.acquire(site="engine.py abort")
    try:
        eng.intake.abort(request_id)
    finally:
        lock.release()
