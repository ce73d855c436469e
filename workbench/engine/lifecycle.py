"""What a request goes through, written once for the engine and the simulator.

Admission checks (a prompt that can never run is rejected, naming why), the stop rule,
the events of a step (schedule, packing, finish, step end) and stats(). The engine runs
them around a real forward, the simulator around a step-cost model; neither re-implements
them.
"""
from __future__ import annotations

from ..events import (BatchPacked, EventBus, RequestAdmitted, RequestFinished, RequestPreempted,
                      StepFinished)
from . import seq_ops
from .kv_manager import pages_for
from .outputs import RequestRejected


def check_prompt_len(n: int, max_model_len: int, num_pages: int, page_size: int) -> None:
    """Raise RequestRejected when a prompt of n tokens can never be served."""
    if n < 1:
        raise RequestRejected("the prompt is empty")
    if n >= max_model_len:
        raise RequestRejected(f"prompt of {n} tokens does not fit the model's max length {max_model_len} "
                              f"(one token must be left to generate)")
    if pages_for(n + 1, page_size) > num_pages:
        raise RequestRejected(
            f"prompt of {n} tokens needs {pages_for(n + 1, page_size)} pages of {page_size} tokens, "
            f"more than the whole pool ({num_pages} pages); raise num_pages or kv_cache_bytes")


def max_len(prompt_len: int, max_tokens: int, max_model_len: int, num_pages: int, page_size: int) -> int:
    """The most tokens (prompt + output) a request may reach."""
    return min(max_model_len, num_pages * page_size, prompt_len + max_tokens)


def stop_reason(seq, tok: int | None, eos_token_ids=frozenset()) -> str | None:
    """'stop' on an end-of-sequence or stop token, 'length' at max_tokens or max_len, else None."""
    p = seq.params
    if tok is not None:
        if not p.ignore_eos and tok in eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
    if seq.num_tokens >= length_limit(seq):
        return "length"
    return None


def length_limit(seq) -> int:
    """The length rule as a token count: seq stops when num_tokens reaches this (max_tokens
    outputs after its prompt, or max_len, whichever comes first). Fixed for a sequence's life,
    so the simulator computes it once per request."""
    return min(seq.num_prompt_tokens + seq.params.max_tokens, seq.max_len)


# ---- events -------------------------------------------------------------------------
def emit_schedule(bus: EventBus, step: int, t_ns: int, sched) -> None:
    if sched.preempted and bus.wants(RequestPreempted):
        for s in sched.preempted:
            bus.emit(RequestPreempted(step, t_ns, s.request_id, *s.last_preemption))
    if sched.admitted and bus.wants(RequestAdmitted):
        for s in sched.admitted:
            bus.emit(RequestAdmitted(step, t_ns, s.request_id, s.num_cached_tokens, len(s.pages)))


def emit_packed(bus: EventBus, step: int, t_ns: int, sched, batch=None) -> None:
    """BatchPacked with the lengths of the scheduler's decision and the sequences' own state
    (not the builder's copies: a probe then checks the packed tensors against what was meant)."""
    rids, q, ctx = seq_ops.active().packed_columns(sched.scheduled)     # the simulator emits this every step
    tensors = () if batch is None else (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.slot_mapping,
                                        batch.max_seqlen_q, batch.max_seqlen_k)
    n_decode = q.count(1)
    bus.emit(BatchPacked(step, t_ns, rids, q, ctx, sum(q), len(q) - n_decode - q.count(0), n_decode, *tensors))


def emit_finished(bus: EventBus, step: int, t_ns: int, seq) -> None:
    if bus.wants(RequestFinished):
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        lat = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        bus.emit(RequestFinished(step, t_ns, seq.request_id, seq.finish_reason or "", seq.num_prompt_tokens,
                                 seq.num_output_tokens, seq.num_preemptions, ttft, lat, tuple(seq.output_token_ids)))


def emit_step(bus: EventBus, step: int, t_ns: int, dt_ns: int, sched, pool, scheduler, bytes_weights: int = 0,
              bytes_kv_read: int = 0, bytes_kv_written: int = 0) -> None:
    n_tok, q_pre = seq_ops.active().token_counts(sched.scheduled)
    bus.emit(StepFinished(step, t_ns, dt_ns, n_tok, len(sched.scheduled), q_pre, n_tok - q_pre, bytes_weights,
                          bytes_kv_read, bytes_kv_written, pool.num_used, pool.num_cached_free,
                          len(scheduler.running), len(scheduler.waiting), scheduler.num_preemptions))


def step_bytes(batch, kv, mc) -> tuple[int, int]:
    """(KV bytes read, KV bytes written) by a step's attention: the pages its plan reads, and a K and
    a V row per packed token per layer."""
    plan = batch.attn_plan
    pages = plan.pages_read if plan is not None else 0
    written = batch.num_tokens * 2 * mc.num_kv_heads * mc.head_dim * kv.k[0].element_size() * mc.num_layers
    return pages * kv.bytes_per_page, written


def stats(pool, scheduler, kv_manager, steps: int) -> dict:
    """The counters operators scrape (what vLLM's /metrics exports, by our names)."""
    return {
        "pages_total": pool.num_pages,
        "pages_used": pool.num_used,
        "pages_cached": pool.num_cached_free,
        "pages_free": pool.num_free,
        "kv_cache_usage": pool.usage(),
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_queries": kv_manager.prefix_cache_queries,
        "prefix_cache_hits": kv_manager.prefix_cache_hits,
        "num_evictions": pool.num_evictions,
        "steps": steps,
    }
