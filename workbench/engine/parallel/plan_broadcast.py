"""The step plan: what rank 0 sends every rank before each forward, as int64 tensors (no pickle).

Two broadcasts a step: a fixed header, then one int64 payload whose length the header gives:

    header  [cmd, step, B, T, W, S, payload_len, flags, table_crc, n_updates, max_q, max_k, 0...]
    payload input_ids[T] | positions[T] | cu_seqlens_q[B+1] | cu_seqlens_k[B+1] | context_lens[B]
            | logits_indices[S] | request_ids[B] | block_table[B*W] | updates

The block table is the driver's bound table, the one source of truth: every rank binds
those bytes after checking their crc32 against the header's (digest-checked). `updates`
are the driver's page-table updates, one record per request whose page list changed since
the last plan (admitted, grew, shrank by preemption: `rid, n, p0 .. pn-1`) or that left
(`rid, -1`); each rank applies them to its own host copy of the page lists (HostCopy), which
is also its account of which pages of its KV shard hold live data (the pool digest the
consistency probe compares). Field note 9's production setup bound each card's table from
such a host copy instead: the rank_desync fault puts a rank back on it.

Control messages (install a per-step tap, switch a rank's table source, call a function on
every rank) carry JSON bytes as a uint8 payload.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..batch import PackedBatch

HEADER = 16
CMD_STEP, CMD_CONTROL, CMD_CALL, CMD_SHUTDOWN = 1, 2, 3, 4
FLAG_STATS = 1              # the driver wants each rank's RankStepFinished numbers
FLAG_TAPS = 2               # per-step taps are installed (their vectors are all-gathered)
RELEASED = -1


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


def header(cmd: int, step: int = 0, payload_len: int = 0, **fields) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0], h[1], h[6] = cmd, step, payload_len
    for i, name in ((2, "B"), (3, "T"), (4, "W"), (5, "S"), (7, "flags"), (8, "table_crc"), (9, "n_updates"),
                    (10, "max_q"), (11, "max_k")):
        h[i] = int(fields.get(name, 0))
    return h


def json_payload(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def read_json(payload: torch.Tensor):
    return json.loads(payload.numpy().tobytes().decode())


# ---- the driver's side ---------------------------------------------------------------
class UpdateTracker:
    """The page lists the driver last sent per request; updates() is what changed since."""

    def __init__(self):
        self.sent: dict[int, tuple] = {}

    def updates(self, batch_seqs, running) -> tuple[list[int], int]:
        """(flattened records, number of records) for this step: every sequence in the batch whose
        page list differs from the one sent, every request sent before that no longer holds pages."""
        out: list[int] = []
        n = 0
        live = set()
        for s in batch_seqs:
            rid = s.request_id
            live.add(rid)
            pages = tuple(s.pages)
            if self.sent.get(rid) != pages:
                self.sent[rid] = pages
                out += (rid, len(pages), *pages)
                n += 1
        for s in running:
            if s.pages:
                live.add(s.request_id)
        for rid in [r for r in self.sent if r not in live]:
            del self.sent[rid]
            out += (rid, RELEASED)
            n += 1
        return out, n

    def resync(self) -> None:
        """Forget what was sent: the next plan carries every live page list in full."""
        self.sent.clear()


def encode_step(step: int, batch: PackedBatch, updates: list[int], n_updates: int, flags: int):
    """(header, payload, the bound table [B, W] int32 as sent) for one forward."""
    b, t = batch.num_seqs, batch.num_tokens
    table = batch.block_tables.detach().to("cpu").contiguous().numpy()
    w = table.shape[1] if table.ndim == 2 else 0
    li = batch.logits_indices.detach().to("cpu").numpy()
    parts = [batch.input_ids.cpu().numpy(), batch.positions.cpu().numpy(), batch.cu_seqlens_q.cpu().numpy(),
             batch.cu_seqlens_k.cpu().numpy(), batch.context_lens.cpu().numpy(), li,
             np.fromiter((s.request_id for s in batch.seqs), np.int64, b), table.reshape(-1),
             np.asarray(updates, dtype=np.int64)]
    payload = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    h = header(CMD_STEP, step, payload.numel(), B=b, T=t, W=w, S=len(li), flags=flags, table_crc=crc(table),
               n_updates=n_updates, max_q=batch.max_seqlen_q, max_k=batch.max_seqlen_k)
    return h, payload, table


# ---- every rank's side ------------------------------------------------------------------
@dataclass
class StepPlan:
    step: int
    input_ids: np.ndarray
    positions: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    context_lens: np.ndarray
    logits_indices: np.ndarray
    request_ids: np.ndarray
    table: np.ndarray            # [B, W] int32: the driver's bound table
    table_crc: int
    updates: np.ndarray
    n_updates: int
    flags: int
    max_q: int
    max_k: int


def decode_step(h: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    hv = h.tolist()
    _, step, b, t, w, s, _, flags, tcrc, n_up, max_q, max_k = hv[:12]
    p = payload.numpy()
    o = 0

    def take(n):
        nonlocal o
        a = p[o:o + n]
        o += n
        return a
    ids, pos, cu_q, cu_k, ctx, li, rids = take(t), take(t), take(b + 1), take(b + 1), take(b), take(s), take(b)
    table = take(b * w).astype(np.int32).reshape(b, w)
    return StepPlan(step, ids, pos, cu_q, cu_k, ctx, li, rids, table, tcrc, p[o:], n_up, flags, max_q, max_k)


class HostCopy:
    """A rank's own copy of every live request's page list, kept by the driver's updates, and the
    refcounts they imply (how many live page lists map each page of this rank's KV shard)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.pages: dict[int, list[int]] = {}
        self.ref = np.zeros(num_pages, dtype=np.int64)

    def records(self, updates: np.ndarray):
        """(rid, pages or None for a release) for each record of a plan's updates."""
        u = updates.tolist()
        i = 0
        while i < len(u):
            rid, n = u[i], u[i + 1]
            if n == RELEASED:
                yield rid, None
                i += 2
            else:
                yield rid, u[i + 2:i + 2 + n]
                i += 2 + n

    def apply(self, rid: int, pages: list[int] | None) -> None:
        old = self.pages.pop(rid, None)
        if old:
            np.subtract.at(self.ref, np.asarray(old, dtype=np.int64) % self.num_pages, 1)
        if pages is not None:
            self.pages[rid] = list(pages)
            if pages:
                np.add.at(self.ref, np.asarray(pages, dtype=np.int64) % self.num_pages, 1)

    def clear(self) -> None:
        self.pages.clear()
        self.ref[:] = 0

    def rows(self, request_ids: np.ndarray, width: int) -> np.ndarray:
        """The block table [B, width] this copy makes for the batch's requests (zero padded)."""
        out = np.zeros((len(request_ids), width), dtype=np.int32)
        for i, rid in enumerate(request_ids.tolist()):
            pages = self.pages.get(rid, ())[:width]
            out[i, :len(pages)] = pages
        return out


@dataclass
class RowRef:
    """A batch row on a worker: the request it belongs to (the driver holds the Sequence)."""
    request_id: int


def build_batch(builder, plan: StepPlan, table: np.ndarray, page_size: int) -> PackedBatch:
    """This rank's PackedBatch for the plan, in the builder's reused buffers: the driver's token ids,
    positions and lengths; `table` staged and bound in this rank's own BlockTables (version and
    checksum as on the driver); the slot mapping computed from the bound rows."""
    b, t = len(plan.request_ids), len(plan.input_ids)
    builder.input_ids.np[:t] = plan.input_ids
    builder.positions.np[:t] = plan.positions
    builder.cu_q.np[:b + 1] = plan.cu_q
    builder.cu_k.np[:b + 1] = plan.cu_k
    builder.context_lens.np[:b] = plan.context_lens
    bt = builder.block_tables
    host = bt.fill_host(list(table)) if b else bt.fill_host([[]])
    q_lens = np.diff(plan.cu_q).astype(np.int64)
    seq_of_tok = np.repeat(np.arange(b), q_lens)
    pos = plan.positions
    builder.slot_mapping.np[:t] = host[seq_of_tok, pos // page_size].astype(np.int64) * page_size + pos % page_size
    bound = bt.bind()
    return PackedBatch(
        input_ids=builder.input_ids.publish(t), positions=builder.positions.publish(t),
        cu_seqlens_q=builder.cu_q.publish(b + 1), cu_seqlens_k=builder.cu_k.publish(b + 1),
        max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k, slot_mapping=builder.slot_mapping.publish(t),
        context_lens=builder.context_lens.publish(b), block_tables=bound,
        block_tables_version=bt.host_version, block_tables_checksum=bt.host_checksum,
        logits_indices=torch.from_numpy(plan.logits_indices.copy()),
        seqs=[RowRef(int(r)) for r in plan.request_ids.tolist()], sample_seq_idx=np.zeros(0, dtype=np.int64),
        query_lens_np=q_lens, context_lens_np=plan.context_lens.copy(), cu_seqlens_q_np=plan.cu_q.astype(np.int32),
        page_size=page_size)
