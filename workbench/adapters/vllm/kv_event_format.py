"""vLLM's KV cache event batches, decoded: the wire format of --kv-events-config's publisher.

A batch is msgspec's encoding of KVEventBatch, an array [ts, events, data_parallel_rank]; each event
a map tagged "type" (BlockStored, BlockRemoved, AllBlocksCleared; any other type is kept as an
UnknownEvent and counted). A malformed batch raises KVEventFormatError naming the sequence number,
the event and the field. Split from kv_events.py (the live subscriber), which re-exports these names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import msgpack

Hash = Union[int, bytes]          # 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), else bytes


# ---- decoded events ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered vLLM's prefix cache: a chain, each block's parent the one before it."""
    block_hashes: list[Hash]
    parent_block_hash: Hash | None          # the parent of block_hashes[0]
    token_ids: list[int]                    # the tokens of all the blocks, in order
    block_size: int
    lora_id: int | None = None
    medium: str | None = None               # "GPU", "CPU" (offloading), ...
    lora_name: str | None = None
    group_idx: int | None = None            # KV cache group (hybrid models)
    extra: dict[str, Any] = field(default_factory=dict)   # optional keys not interpreted here


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left vLLM's prefix cache (evicted)."""
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """vLLM emptied its prefix cache (reset_prefix_cache)."""


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event type this module does not know (a newer vLLM): counted, not applied."""
    type: str
    fields: dict[str, Any]


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, UnknownEvent]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int
    ts: float                   # vLLM's time.time() when the step's events were taken
    events: list[KVEvent]
    dp_rank: int | None


class KVEventFormatError(ValueError):
    """A payload that is not a KVEventBatch as vLLM encodes it."""


# ---- decoding ------------------------------------------------------------------------
def _kind(v) -> str:
    return f"{v!r} ({type(v).__name__})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_hash(v) -> bool:
    return _is_int(v) or isinstance(v, bytes)


class _Fields:
    """Typed reads of one event map; a wrong field raises naming the seq and the field path."""

    def __init__(self, seq: int, where: str, m: dict):
        self.seq, self.where, self.m = seq, where, m

    def fail(self, key: str, what: str):
        raise KVEventFormatError(f"KV event batch {self.seq}: {self.where}.{key} {what}")

    def get(self, key: str, ok: Callable[[Any], bool], expected: str, required: bool = False):
        if key not in self.m:
            if required:
                self.fail(key, "is missing")
            return None
        v = self.m[key]
        if v is None and not required:      # optional fields are nullable in vLLM's structs
            return None
        if not ok(v):
            self.fail(key, f"is {_kind(v)}, expected {expected}")
        return v

    def items(self, key: str, ok: Callable[[Any], bool], expected: str) -> list:
        v = self.get(key, lambda x: isinstance(x, list), "a list", required=True)
        for i, x in enumerate(v):
            if not ok(x):
                self.fail(f"{key}[{i}]", f"is {_kind(x)}, expected {expected}")
        return v


_STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "lora_id", "medium", "lora_name", "group_idx"}
_REMOVED_KEYS = {"type", "block_hashes", "medium", "group_idx"}
_str = (lambda v: isinstance(v, str), "a string")
_int = (_is_int, "an int")


def _decode_event(seq: int, i: int, m) -> KVEvent:
    where = f"events[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("type"), str):
        raise KVEventFormatError(f"KV event batch {seq}: {where} is {_kind(m)[:120]}, "
                                 "expected a map with a string 'type'")
    f, kind = _Fields(seq, where, m), m["type"]
    if kind == "BlockStored":
        bs = f.get("block_size", _is_int, "an int", required=True)
        if bs <= 0:
            f.fail("block_size", f"is {bs}, expected > 0")
        return BlockStored(
            block_hashes=f.items("block_hashes", _is_hash, "an int or bytes hash"),
            parent_block_hash=f.get("parent_block_hash", _is_hash, "an int or bytes hash or None"),
            token_ids=f.items("token_ids", _is_int, "an int token id"),
            block_size=bs, lora_id=f.get("lora_id", *_int), medium=f.get("medium", *_str),
            lora_name=f.get("lora_name", *_str), group_idx=f.get("group_idx", *_int),
            extra={k: v for k, v in m.items() if k not in _STORED_KEYS})
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=f.items("block_hashes", _is_hash, "an int or bytes hash"),
            medium=f.get("medium", *_str), group_idx=f.get("group_idx", *_int),
            extra={k: v for k, v in m.items() if k not in _REMOVED_KEYS})
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(kind, {k: v for k, v in m.items() if k != "type"})


def decode_batch(seq: int, payload: bytes) -> KVEventBatch:
    """One published payload -> KVEventBatch; KVEventFormatError names the seq and the bad field."""
    try:
        top = msgpack.unpackb(payload, raw=False)
    except Exception as e:      # msgpack raises several unrelated types (ExtraData, ValueError, ...)
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise KVEventFormatError(f"KV event batch {seq}: payload is not msgpack ({detail})") from None
    # msgspec's array_like encoding; omit_defaults may drop a trailing data_parallel_rank=None
    if not isinstance(top, list) or len(top) not in (2, 3):
        raise KVEventFormatError(f"KV event batch {seq}: payload is {_kind(top)[:120]}, "
                                 "expected an array [ts, events, data_parallel_rank]")
    ts, events = top[0], top[1]
    dp_rank = top[2] if len(top) == 3 else None
    if not (isinstance(ts, (int, float)) and not isinstance(ts, bool)):
        raise KVEventFormatError(f"KV event batch {seq}: ts is {_kind(ts)}, expected a number")
    if not isinstance(events, list):
        raise KVEventFormatError(f"KV event batch {seq}: events is {_kind(events)[:120]}, expected a list")
    if dp_rank is not None and not _is_int(dp_rank):
        raise KVEventFormatError(f"KV event batch {seq}: data_parallel_rank is {_kind(dp_rank)}, "
                                 "expected an int or None")
    return KVEventBatch(seq, float(ts), [_decode_event(seq, i, m) for i, m in enumerate(events)], dp_rank)
