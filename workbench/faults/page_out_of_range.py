"""page_out_of_range: a page id past the pool in the bound device block table (field note 2).

For `steps` forwards, one id in one request's row of the bound device block table is
replaced by `page_id` (default num_pages, the first id past the pool). The Ascend and
CUDA paged kernels do not validate block ids: they read whatever lies past the pool,
which on a device is other allocations or stale memory, so the request decodes NaN, zeros
or garbage (or the card raises an illegal access when the address is unmapped).

torch on CPU does check indices, so by itself the id would raise IndexError instead. To
reproduce what the device did, the fault also models the memory past the pool
(`unchecked=True`): the attention gather reads ids >= num_pages from a slab filled with
`fill` ("nan", as freed device memory often held, or "zeros") instead of raising. The
page table is corrupted exactly as in production; only the out-of-bounds read itself is
emulated. unchecked=False keeps torch's check: the IndexError stands in for the
illegal-access crash.
"""
from __future__ import annotations

import torch

from .base import Fault, forget_cached_since


class PageOutOfRange(Fault):
    name = "page_out_of_range"
    symptom = "one request decodes NaN / zeros / garbage (or the card raises an illegal memory access)"
    cause = "a page id >= num_pages reached the bound device block table; the kernel read past the KV pool"
    caught_by = "page_table probe: page id outside [0, num_pages) in the bound block table (page-out-of-range)"
    fix = "find the writer of the bad id (table sized for another pool, unmasked padding, another card's " \
          "pool); validate ids in [0, num_pages) at bind time in debug builds"
    notebook = "notebooks/page_out_of_range.ipynb"

    def __init__(self, engine, request_id=None, row: int | None = None, column: int = -1,
                 page_id: int | None = None, steps: int = 1, fill: str = "nan", unchecked: bool = True):
        """request_id / row: whose table row (None: the first that reads pages); column: which of its
        pages (-1: the newest); page_id: the bad id (default num_pages); fill: what lies past the
        pool ("nan" | "zeros"); unchecked: read it as device memory would (no bounds check)."""
        super().__init__(engine, request_id=request_id, row=row, column=column, page_id=page_id, steps=steps,
                         fill=fill, unchecked=unchecked)
        if fill not in ("nan", "zeros"):
            raise ValueError(f"fill={fill!r} is not one of nan, zeros")
        self.request_id, self.row, self.column, self.steps, self.unchecked = request_id, row, column, steps, unchecked
        self._page_id = page_id
        self.fill = {"nan": float("nan"), "zeros": 0.0}[fill]

    def on_enable(self) -> None:
        eng = self.engine
        self.page_id = eng.pool.num_pages if self._page_id is None else self._page_id
        self.remaining = self.steps
        self.corrupted: list[dict] = []                 # step, request_id, row, column, page_id, page_meant
        self._cached_before = dict(self.engine.pool.cached)
        build = eng.builder.build

        def build_then_corrupt(scheduled, *a, **kw):
            batch = build(scheduled, *a, **kw)
            if self.remaining > 0:
                self._corrupt(batch)
            return batch

        self.patch(eng.builder, "build", build_then_corrupt)
        attn = eng.attn
        if self.unchecked and hasattr(attn, "gather"):
            gather, fill = attn.gather, self.fill

            def unchecked_read(cache, pages, rows, dtype):
                n = cache.shape[0]
                bad = (pages < 0) | (pages >= n)
                if not bool(bad.any()):
                    return gather(cache, pages, rows, dtype)
                out = gather(cache, torch.where(bad, torch.zeros_like(pages), pages), rows, dtype)
                out.view(pages.shape[0], -1)[bad] = fill          # what lies past the pool
                return out

            # Device memory has no bounds check: every page read goes through this reader
            # (the backend's page_reader seam; a compiled kernel that reads in place steps aside).
            self.patch(attn, "page_reader", unchecked_read)

    def _corrupt(self, batch) -> None:
        reads = batch.context_lens_np > batch.query_lens_np        # rows whose kernel reads the table
        rows = [i for i, s in enumerate(batch.seqs) if reads[i]
                and (self.request_id is None or s.request_id == self.request_id)
                and (self.row is None or i == self.row)]
        if not rows:
            return
        r = rows[0]
        need = -(-int(batch.context_lens_np[r]) // batch.page_size)
        c = self.column if self.column >= 0 else need + self.column
        c = min(max(c, 0), need - 1)
        meant = int(batch.block_tables[r, c])
        batch.block_tables[r, c] = self.page_id                     # the bound device table
        self.remaining -= 1
        self.corrupted.append({"step": self.engine.step_count, "request_id": batch.seqs[r].request_id,
                               "row": r, "column": c, "page_id": self.page_id, "page_meant": meant})

    def on_disable(self) -> None:
        # K/V computed while the fault was on is garbled: keep it out of the prefix cache.
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
