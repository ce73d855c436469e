"""Faults planted in vLLM's own code paths, through the plugin's seams, for tests and notebooks.

Each reproduces a production bug in the engine users run, where our checks must see it:

  permuted_block_table_rows    the block table the kernel reads has rows 0 and 1 swapped (a
                               condense / swap_states that moved one copy and not the other)
  slot_mapping_off_at_boundary the first token of every block after the first writes to the
                               slot one past the previous block's end (an off-by-one in the
                               page index at a block boundary)
  abort_keeps_blocks           an aborted request's blocks are never freed (an abort path that
                               skips kv_cache_manager.free: the SGLang-style leak)
  prefix_hash_ignores_last_token  the prefix-cache block hash leaves out each block's last token,
                               so two prompts that differ only there share K/V (a hash that
                               forgets part of its key: wrong text with every bookkeeping check
                               passing; the plugin's prefix provenance sees it)
  admission_refuses_long_prompts  allocate_slots refuses every waiting request with a prompt over
                               120 tokens although the pool has room (admission arithmetic gone
                               wrong): it waits forever, and so does the queue behind it
  window_frees_one_block_early  a sliding-window group's trailing edge is computed one block too
                               far on (get_num_skipped_tokens), so the block that still holds the
                               window's oldest tokens is freed and handed to another request
                               while the kernel reads it (hybrid models: the off-by-one of the
                               window arithmetic)
  prefix_hit_skips_ref         BlockPool.touch takes no reference on a hit block that another
                               request already holds (the `ref_cnt == 0` branch's increment
                               placed inside it): the first holder's free returns the block to
                               the pool while the second still reads it
  add_loses_request            Scheduler.add_request records request r2 but never queues it (an
                               enqueue lost in a refactor of the add path): vLLM keeps it
                               unfinished forever and its client waits; nothing is scheduled
                               for it, so no check of the pool or the metadata sees it
  resume_appends_blocks        the worker treats a request resumed after preemption as a running
                               one: its new block ids are appended to the old, freed ones
                               instead of replacing them (the runner's resumed_from_preemption
                               branch lost), so the kernel reads blocks other requests now own

Math faults in the attention backend (issue 37), for the attention check: none changes a
bookkeeping tensor the metadata check reads, so only a check of what attention computes sees them.

  attention_scale_1_over_d     the kernel runs with scale 1/head_dim instead of the model's
                               (1/sqrt(head_dim)): the softmax too flat, everywhere
  attention_decode_misses_newest  decode rows attend over all keys but their own newest one: the
                               kernel is handed seq_lens one short for rows of one query token
                               (a mask one behind in decode; CPU backend, its scheduler metadata
                               rebuilt for the shorter lengths)
  attention_decode_kv_head_slip   in decode rows only, query heads read the next KV head's K/V
                               (a GQA map slip in a decode-only kernel path); needs >= 2 KV heads
  attention_page_walk_repeats_page  the kernel's block table repeats each row's first page in
                               place of its second (a page walk that does not advance: the second
                               page's keys are never read, the first page's twice)
  kv_write_heads_reversed      the K handed to the cache write has its KV heads in reverse order
                               (a head-layout slip in the store); needs >= 2 KV heads

Which are on is read from a JSON file, {"faults": [names]}, named by
PAGEDKV_VLLM_FAULT_FILE; every vLLM process re-reads it when its mtime changes (checked at
most every 0.2 s), so a test or a notebook switches a fault on and off while the server runs.
Without the variable no seam does anything but return its input.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace


FAULTS = ("permuted_block_table_rows", "slot_mapping_off_at_boundary", "abort_keeps_blocks",
          "prefix_hash_ignores_last_token", "admission_refuses_long_prompts", "window_frees_one_block_early",
          "prefix_hit_skips_ref", "resume_appends_blocks", "add_loses_request",
          "attention_scale_1_over_d", "attention_decode_misses_newest", "attention_decode_kv_head_slip",
          "attention_page_walk_repeats_page", "kv_write_heads_reversed")
MATH_FAULTS = FAULTS[-5:]


class FaultSwitch:
    """Which faults are on, re-read from the file when it changes. A bad file (unreadable, not JSON,
    not {"faults": [names]}, an unknown name) switches every fault off and says why, once per
    change of the file, through on_error: it never raises into vLLM."""

    def __init__(self, path: str | None, on_error=None):
        self.path = path
        self.active: frozenset[str] = frozenset()
        self._mtime = None
        self._checked = 0.0
        self.errors: list[str] = []
        self.on_error = on_error

    def on(self, name: str) -> bool:
        if self.path is None:
            return False
        now = time.monotonic()
        if now - self._checked > 0.2:
            self._checked = now
            self._reload()
        return name in self.active

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            self.active = frozenset()
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self.active = frozenset(read_fault_file(self.path))
        except (OSError, ValueError) as e:
            self.active = frozenset()
            self.errors.append(str(e))
            del self.errors[:-20]
            if self.on_error is not None:
                self.on_error(f"{e}; no vLLM fault is planted")


def read_fault_file(path: str) -> list[str]:
    """The fault names in a fault file; ValueError naming the file and what is wrong."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"fault file {path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or "faults" not in doc:
        raise ValueError(f'fault file {path}: want an object {{"faults": [names]}}, got {text[:60]!r}')
    names = doc["faults"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f'fault file {path}: "faults" must be a list of names, got {names!r}'[:200])
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"fault file {path}: unknown vLLM faults {unknown}; known: {', '.join(FAULTS)}")
    return names


def write_fault_file(path: str, *names: str) -> None:
    """Switch exactly these faults on (none: all off), atomically, for every vLLM process."""
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown vLLM faults {unknown}; known: {', '.join(FAULTS)}")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"faults": list(names)}, f)
    os.replace(tmp, path)


# ---- the seams: each returns what vLLM goes on with -------------------------------------------
def metadata(switch: FaultSwitch, cm, block_size: int):
    """CommonAttentionMetadata as the kernel will get it."""
    if switch.on("permuted_block_table_rows") and cm.num_reqs >= 2:
        bt = cm.block_table_tensor.clone()
        bt[[0, 1]] = bt[[1, 0]]
        cm = replace(cm, block_table_tensor=bt)
    if switch.on("slot_mapping_off_at_boundary") and cm.positions is not None:
        # In place: the metadata's slot_mapping is a view of the runner's block-table slot mapping,
        # the same tensor the forward context hands the KV-cache write (vLLM 0.32 writes K/V
        # from there, not from the backend's metadata), so the misplaced rows really land.
        t = cm.num_actual_tokens
        pos = cm.positions[:t]
        edge = (pos % block_size == 0) & (pos > 0)
        cm.slot_mapping[:t][edge] += block_size   # one block on: the page index off by one at the boundary
    return cm


def skip_free(switch: FaultSwitch, request) -> bool:
    """True when this request's blocks must not be freed (the abort leak)."""
    if not switch.on("abort_keeps_blocks"):
        return False
    status = getattr(request, "status", None)
    return status is not None and "ABORT" in getattr(status, "name", str(status))


def lose_at_add(switch: FaultSwitch, request) -> bool:
    """True when the add path must leave this request out of the queues (request r2 only)."""
    return switch.on("add_loses_request") and str(getattr(request, "request_id", "")) == "r2"


def block_tokens(switch: FaultSwitch, tokens):
    """The token ids vLLM's block hash covers."""
    if switch.on("prefix_hash_ignores_last_token") and len(tokens) > 1:
        return tokens[:-1]
    return tokens


def refuse_admission(switch: FaultSwitch, request) -> bool:
    """True when this allocation must fail as if the pool were full (the admission fault)."""
    if not switch.on("admission_refuses_long_prompts"):
        return False
    status = getattr(getattr(request, "status", None), "name", "")
    return status.startswith("WAITING") and getattr(request, "num_prompt_tokens", 0) > 120


def window_skipped(switch: FaultSwitch, skipped: int, block_size: int) -> int:
    """The tokens a sliding-window group may free (SlidingWindowManager.get_num_skipped_tokens)."""
    if switch.on("window_frees_one_block_early") and skipped > 0:
        return skipped + block_size
    return skipped


def hit_refs_kept(switch: FaultSwitch, blocks) -> list:
    """BlockPool.touch: the blocks whose reference the fault takes back after the touch (those
    another request already held)."""
    if not switch.on("prefix_hit_skips_ref"):
        return []
    return [b for b in blocks if b.ref_cnt > 0 and not getattr(b, "is_null", False)]


def worker_output(switch: FaultSwitch, so):
    """The SchedulerOutput the model runner applies (the engine core keeps its own)."""
    c = getattr(so, "scheduled_cached_reqs", None)
    if not switch.on("resume_appends_blocks") or c is None or not getattr(c, "resumed_req_ids", None):
        return so
    from copy import copy
    so, c = copy(so), copy(c)
    c.resumed_req_ids = set()
    so.scheduled_cached_reqs = c
    return so


# ---- the attention backend's seams (AttentionImpl.forward / do_kv_cache_update) -------------
def _qlens(md):
    qsl = getattr(md, "query_start_loc", None)
    return None if qsl is None else (qsl[1:] - qsl[:-1]).to("cpu")


def attention_forward(switch: FaultSwitch, orig, impl, layer, query, key, value, kv_cache, md, output, *a, **kw):
    """impl.forward as the backend runs it, with the math faults that are on."""
    if md is None or switch.path is None or not any(switch.on(n) for n in MATH_FAULTS):
        return orig(impl, layer, query, key, value, kv_cache, md, output, *a, **kw)
    import dataclasses
    restore = []
    decode_tokens = None
    qlens = _qlens(md)
    if qlens is not None:
        starts = md.query_start_loc[:-1].to("cpu").long()
        decode_tokens = starts[qlens == 1]
    try:
        if switch.on("attention_scale_1_over_d"):
            restore.append(("scale", impl.scale))
            impl.scale = 1.0 / impl.head_size
        if switch.on("attention_page_walk_repeats_page") and hasattr(md, "block_table"):
            bt = md.block_table.clone()
            bs = kv_cache.shape[2]
            two = (md.seq_lens[: bt.shape[0]].to(bt.device) > bs) & (bt.shape[1] > 1)
            bt[two, 1] = bt[two, 0]
            md = dataclasses.replace(md, block_table=bt)
        if switch.on("attention_decode_misses_newest") and decode_tokens is not None and len(decode_tokens) \
                and hasattr(md, "scheduler_metadata"):
            md = _seq_lens_short(impl, layer, query, md, qlens)
        if switch.on("attention_decode_kv_head_slip") and decode_tokens is not None and len(decode_tokens) \
                and impl.num_kv_heads > 1:
            g = impl.num_heads // impl.num_kv_heads
            query = query.clone()
            query[decode_tokens] = query[decode_tokens].roll(g, dims=1)
            out = orig(impl, layer, query, key, value, kv_cache, md, output, *a, **kw)
            o3 = output.view(output.shape[0], impl.num_heads, -1)
            o3[decode_tokens] = o3[decode_tokens].roll(-g, dims=1)   # head h got KV head h // g + 1's read
            return out
        return orig(impl, layer, query, key, value, kv_cache, md, output, *a, **kw)
    finally:
        for name, v in restore:
            setattr(impl, name, v)


def _seq_lens_short(impl, layer, query, md, qlens):
    """The CPU backend's metadata with decode rows one key short, its work split rebuilt to match."""
    import dataclasses

    from vllm import _custom_ops as ops
    from vllm import envs
    sl = md.seq_lens.clone()
    sl[: len(qlens)][qlens.to(sl.device) == 1] -= 1
    sm = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(qlens), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
        seq_lens=sl, dtype=query.dtype, query_start_loc=md.query_start_loc, causal=md.causal,
        sliding_window_size=impl.sliding_window, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=md.dynamic_causal, kv_cache_dtype=impl.kv_cache_dtype)
    return dataclasses.replace(md, seq_lens=sl, scheduler_metadata=sm)


def kv_write(switch: FaultSwitch, key, value):
    """The K / V impl.do_kv_cache_update stores."""
    if switch.on("kv_write_heads_reversed") and key.dim() == 3 and key.shape[1] > 1:
        key = key.flip(1)
    return key, value
