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
  resume_appends_blocks        the worker treats a request resumed after preemption as a running
                               one: its new block ids are appended to the old, freed ones
                               instead of replacing them (the runner's resumed_from_preemption
                               branch lost), so the kernel reads blocks other requests now own

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
          "prefix_hit_skips_ref", "resume_appends_blocks")


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
