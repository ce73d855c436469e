"""PackedBatch: every token of a step in one buffer, sliced per sequence by cu_seqlens.

Prefill chunks and decodes share one step. All index tensors are built with numpy in
host buffers allocated once and reused every step (field note 7: a fresh cu_seqlens
tensor per step leaked ~500 MB in hours), then copied to the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .block_table import BlockTables
from .sequence import Sequence


@dataclass
class PackedBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    cu_seqlens_q: torch.Tensor     # [B+1] int32, starts at 0, ends at T
    cu_seqlens_k: torch.Tensor     # [B+1] int32, cumulative context lengths after this step
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor     # [T] int64: page * page_size + offset of each new token
    context_lens: torch.Tensor     # [B] int32: tokens of context each query attends to
    block_tables: torch.Tensor     # [B, W] int32 view of the device buffer the kernels read
    block_tables_version: int      # version / checksum of the table current for this step
    block_tables_checksum: int
    logits_indices: torch.Tensor   # [S] int64: rows whose next token is sampled
    seqs: list[Sequence]
    sample_seq_idx: np.ndarray     # [S]: index into seqs of each sampled row
    # host copies, for attention dispatch without a device sync
    query_lens_np: np.ndarray
    context_lens_np: np.ndarray
    cu_seqlens_q_np: np.ndarray
    page_size: int
    attn_plan: object = None       # the attention backend's per-step index plan, shared by all layers
    # While the model's hooks want each row's max |K| and |V| (ModelHooks.ROW_STATS): the forward's
    # [L, 2 or 4, T] float32 buffer and the layer being stored, whose slice a fused store (rope_write)
    # fills as it goes (and says so); else None. A [S, T] tensor with kv_layer -1: that slice itself.
    kv_absmax: torch.Tensor | None = None
    kv_layer: int = -1
    # (sequence, first position, count): prompt rows whose logits follow the sampled rows in
    # logits_indices, for SamplingParams.prompt_logprobs
    prompt_logprob_spans: list = None

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q_np[-1])


class _Buffer:
    """A host tensor with a numpy view, plus its device twin (the same tensor on CPU)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        self.host = torch.zeros(n, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.zeros(n, dtype=dtype, device=device)

    def publish(self, n: int) -> torch.Tensor:
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class BatchBuilder:
    # Fault seams (faults/base.py Fault.patch may replace only these): `build`, wrapped to stage the
    # table without binding it (stale_binding), or to corrupt what it packed (cu_seqlens_corrupt,
    # page_out_of_range) or hand out fresh buffers (buffer_leak); same signature, a PackedBatch back.
    FAULT_SEAMS = frozenset({"build"})

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, max_pages_per_seq: int,
                 page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = torch.device(device)
        t, b = max_num_batched_tokens, max_num_seqs
        self.max_tokens, self.max_seqs = t, b
        d = self.device
        self.input_ids = _Buffer(t, torch.int64, d)
        self.positions = _Buffer(t, torch.int64, d)
        self.slot_mapping = _Buffer(t, torch.int64, d)
        self.cu_q = _Buffer(b + 1, torch.int32, d)
        self.cu_k = _Buffer(b + 1, torch.int32, d)
        self.context_lens = _Buffer(b, torch.int32, d)
        self.logits_indices = _Buffer(b, torch.int64, d)
        self.block_tables = BlockTables(b, max_pages_per_seq, d)

    def build(self, scheduled: list[tuple[Sequence, int]], bind: bool = True,
              all_logits: bool = False) -> PackedBatch:
        """scheduled: (sequence, tokens to compute this step) in batch order.

        all_logits: logits for every token (teacher forcing), not just the sampled rows.
        """
        ps = self.page_size
        b = len(scheduled)
        if b == 0 or b > self.max_seqs:
            raise ValueError(f"batch of {b} sequences (max {self.max_seqs})")
        seqs = [s for s, _ in scheduled]
        q_lens = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=b)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=b)
        ctx = starts + q_lens
        t = int(q_lens.sum())
        if t > self.max_tokens:
            raise ValueError(f"batch of {t} tokens (max {self.max_tokens})")

        cu_q = self.cu_q.np[: b + 1]
        cu_q[0] = 0
        cu_q[1:] = np.cumsum(q_lens)
        cu_k = self.cu_k.np[: b + 1]
        cu_k[0] = 0
        cu_k[1:] = np.cumsum(ctx)
        self.context_lens.np[:b] = ctx

        # Per-token index arithmetic, vectorised: seq index, position, slot.
        seq_of_tok = np.repeat(np.arange(b), q_lens)
        pos = self.positions.np[:t]
        pos[:] = np.arange(t) - np.repeat(cu_q[:-1].astype(np.int64) - starts, q_lens)
        ids = self.input_ids.np[:t]
        ids[:] = np.fromiter(
            (tok for s, n in scheduled for tok in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]),
            dtype=np.int64, count=t)
        host_bt = self.block_tables.fill_host([s.pages for s in seqs])
        self.slot_mapping.np[:t] = host_bt[seq_of_tok, pos // ps].astype(np.int64) * ps + pos % ps

        # A row is sampled when its sequence has computed every known token after this step.
        total = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=b)
        sample_seq_idx = np.nonzero(ctx == total)[0]
        spans = None
        if all_logits:
            s = t
            logits_indices = torch.arange(t, device=self.device)
        else:
            s = len(sample_seq_idx)
            self.logits_indices.np[:s] = cu_q[1:][sample_seq_idx] - 1
            logits_indices = self.logits_indices.publish(s)
            if any(x.params.prompt_logprobs for x in seqs):
                logits_indices, spans = self._prompt_rows(seqs, starts, ctx, cu_q, self.logits_indices.np[:s])

        # The kernels read the device buffer; bind=False leaves it as the last step left it.
        bt = self.block_tables.bind() if bind else self.block_tables.view()
        return PackedBatch(
            input_ids=self.input_ids.publish(t),
            positions=self.positions.publish(t),
            cu_seqlens_q=self.cu_q.publish(b + 1),
            cu_seqlens_k=self.cu_k.publish(b + 1),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(ctx.max()),
            slot_mapping=self.slot_mapping.publish(t),
            context_lens=self.context_lens.publish(b),
            block_tables=bt,
            block_tables_version=self.block_tables.host_version,
            block_tables_checksum=self.block_tables.host_checksum,
            logits_indices=logits_indices,
            seqs=seqs,
            sample_seq_idx=sample_seq_idx,
            query_lens_np=q_lens,
            context_lens_np=ctx,
            cu_seqlens_q_np=cu_q.copy(),
            page_size=ps,
            prompt_logprob_spans=spans,
        )

    def _prompt_rows(self, seqs, starts, ctx, cu_q, sampled_rows):
        """The rows of this step's prompt positions whose next prompt token is scored: position p of
        a chunk [start, ctx) with prompt_logprobs_from - 1 <= p < prompt length - 1 (the last prompt
        position is the sampled row). Appended after the sampled rows; one span per sequence."""
        rows, spans = [sampled_rows], []
        for i, x in enumerate(seqs):
            if not x.params.prompt_logprobs:
                continue
            lo = max(int(starts[i]), x.params.prompt_logprobs_from - 1)
            hi = min(int(ctx[i]), len(x.prompt_token_ids) - 1)
            if hi > lo:
                rows.append(int(cu_q[i]) - int(starts[i]) + np.arange(lo, hi))
                spans.append((x, lo, hi - lo))
        return torch.from_numpy(np.concatenate(rows).astype(np.int64)).to(self.device), spans
