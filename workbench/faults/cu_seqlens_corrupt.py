"""cu_seqlens_corrupt: the packed cu_seqlens of one batch is wrong (field note 4).

After packing, cu_seqlens is corrupted in the device tensor and in the host copy the
attention backend plans its segments from (PackedBatch.cu_seqlens_q_np), so the kernel
really uses it: attention covers the wrong span, nothing raises, and the output of the
sequences around the bad entry is garbage. Modes:
- "swap": entries index and index+1 swapped (non-monotonic; default);
- "truncate": the trailing total dropped (the last entry repeats the one before it);
- "shift": entry index moved by `delta` tokens (still monotonic: only the spans are wrong).
tensor="k" corrupts cu_seqlens_k instead (the torch backend plans from the context
lengths, so there it is caught but changes no output; fused varlen kernels read it).

The corruption waits for a batch the torch reference can run it through. A swap needs
its neighbouring rows to be decodes (located by their start offset, their queries trade
places and each attends over the other's pages): on a prefill chunk the negative span
makes the reference's planning raise where a fused kernel would silently read the wrong
span. A shift needs two prefill chunks (one attends over too many tokens, the other over
too few). A truncation shows on a last row that is a prefill chunk: it gets an empty
span and its output rows are never written (whatever the output buffer held, as on the
device).
"""
from __future__ import annotations

from .base import Fault, forget_cached_since


class CuSeqlensCorrupt(Fault):
    name = "cu_seqlens_corrupt"
    symptom = "attention over the wrong span: garbage for the sequences around the bad entry, no error"
    cause = "cu_seqlens was modified after packing (swapped / dropped / shifted entries) and the varlen " \
            "kernel trusted it"
    caught_by = "cu_seqlens probe: start 0, non-decreasing, last == total, int32, contiguous, device, B+1"
    fix = "build cu_seqlens once per step from the query lengths (cumsum into a preallocated int32 " \
          "buffer), never edit it afterwards; validate it in debug builds"
    notebook = "notebooks/cu_seqlens_corrupt.ipynb"

    def __init__(self, engine, mode: str = "swap", index: int = 1, delta: int = 1, tensor: str = "q",
                 steps: int = 1):
        """mode: swap | truncate | shift the entry `index` of cu_seqlens_<tensor> (q or k) by `delta`,
        for `steps` steps."""
        super().__init__(engine, mode=mode, index=index, delta=delta, tensor=tensor, steps=steps)
        if mode not in ("swap", "truncate", "shift"):
            raise ValueError(f"mode={mode!r} is not one of swap, truncate, shift")
        if tensor not in ("q", "k"):
            raise ValueError(f"tensor={tensor!r} is not one of q, k")
        self.mode, self.index, self.delta, self.tensor, self.steps = mode, index, delta, tensor, steps

    def on_enable(self) -> None:
        self.remaining = self.steps
        self.corrupted: list[dict] = []       # step, mode, tensor, entry, first_bad, request_id, before, after
        self._cached_before = dict(self.engine.pool.cached)
        build = self.engine.builder.build

        def build_then_corrupt(scheduled, *a, **kw):
            batch = build(scheduled, *a, **kw)
            if self.remaining > 0:
                self._corrupt(batch)
            return batch

        self.patch(self.engine.builder, "build", build_then_corrupt)

    def _eligible(self, batch) -> bool:
        b, q = batch.num_seqs, batch.query_lens_np
        if self.tensor != "q" or self.mode == "truncate":
            return b >= 1
        if b < 2:
            return False
        i = min(max(self.index, 1), b - 1)
        if self.mode == "shift":          # two prefill chunks trade tokens; both spans stay non-empty
            return q[i - 1] > 1 and q[i] > 1 and q[i] - self.delta >= 1 and q[i - 1] + self.delta >= 1
        return all(q[j] == 1 for j in range(i - 1, min(i + 2, b)))

    def _corrupt(self, batch) -> None:
        b = batch.num_seqs
        if not self._eligible(batch):
            return                            # wait for a batch this mode can corrupt (see above)
        targets = [batch.cu_seqlens_q, batch.cu_seqlens_q_np] if self.tensor == "q" else [batch.cu_seqlens_k]
        before = targets[0].tolist()
        if self.mode == "swap":
            i = min(max(self.index, 1), b - 1)
            for t in targets:
                t[i], t[i + 1] = int(t[i + 1]), int(t[i])
        elif self.mode == "truncate":
            i = b
            for t in targets:
                t[i] = int(t[i - 1])
        else:
            i = min(max(self.index, 1), b - 1)
            for t in targets:
                t[i] = int(t[i]) + self.delta
        self.remaining -= 1
        # Entry i ends sequence i-1: that is the first sequence whose span is wrong.
        self.corrupted.append({"step": self.engine.step_count, "mode": self.mode, "tensor": self.tensor,
                               "entry": i, "first_bad": i - 1, "request_id": batch.seqs[i - 1].request_id,
                               "before": before, "after": targets[0].tolist()})

    def on_disable(self) -> None:
        # K/V computed while the fault was on is garbled: keep it out of the prefix cache.
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
