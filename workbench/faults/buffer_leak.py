"""buffer_leak: fresh batch metadata tensors every step, kept alive by the runtime.

Field note 7: the batch builder allocated a new cu_seqlens tensor each step and the
runtime's lazier GC never released them: OOM after ~24 h. Here the builder's build()
is wrapped so every step's index tensors (cu_seqlens_q/k, slot_mapping, positions,
input ids, context lens, block tables, logits indices) are fresh allocations of the
builder's capacity, as a runtime that allocates its metadata workspace per step at the
captured max shape does, zero-filled, and appended to `retained` (the runtime's
pending-free list that never drains). Outputs stay correct; memory (RssAnon) grows.
disable() drops them.
"""
from __future__ import annotations

import torch

from .base import Fault

_FIELDS = {"input_ids": "max_tokens", "positions": "max_tokens", "slot_mapping": "max_tokens",
           "cu_seqlens_q": "seqs+1", "cu_seqlens_k": "seqs+1", "context_lens": "seqs",
           "logits_indices": "seqs"}


class BufferLeak(Fault):
    name = "buffer_leak"
    symptom = "memory grows every step until the process is killed (OOM after ~24 h)"
    cause = ("a fresh cu_seqlens / metadata tensor is allocated every step instead of filling a preallocated "
             "buffer, and the runtime's lazy GC keeps each one alive")
    caught_by = "leak probe: retained per-step tensors (named), steady RssAnon + VmSwap growth"
    fix = "one preallocated buffer per index tensor, filled in place every step (BatchBuilder's _Buffer)"
    notebook = "notebooks/buffer_leak.ipynb"

    def __init__(self, engine):
        super().__init__(engine)

    def on_enable(self) -> None:
        self.retained: list[torch.Tensor] = []
        builder = self.engine.builder
        build = builder.build
        caps = {"max_tokens": builder.max_tokens, "seqs+1": builder.max_seqs + 1, "seqs": builder.max_seqs}
        bt_cap = builder.block_tables.max_num_seqs * builder.block_tables.max_pages_per_seq

        def fresh(t: torch.Tensor, cap: int) -> torch.Tensor:
            ws = torch.zeros(max(cap, t.numel()), dtype=t.dtype, device=t.device)
            self.retained.append(ws)                 # the runtime's pending-free list
            view = ws[: t.numel()].view(t.shape)
            view.copy_(t)
            return view

        def leaky_build(scheduled, *a, **kw):
            batch = build(scheduled, *a, **kw)
            for f, cap in _FIELDS.items():
                setattr(batch, f, fresh(getattr(batch, f), caps[cap]))
            batch.block_tables = fresh(batch.block_tables, bt_cap)
            return batch

        self.patch(builder, "build", leaky_build)

    @property
    def retained_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in getattr(self, "retained", ()))

    def on_disable(self) -> None:
        self.retained = []
