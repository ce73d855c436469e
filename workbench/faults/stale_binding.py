"""stale_binding: the block-table re-bind drifted to after the kernel launch (field note 1).

The batch builder still stages the new host table every step (a new current version),
but the device buffer the kernels read is published only after the forward. Every
forward therefore reads the previous step's binding: harmless while no row changes,
garbled text from the first step in which a sequence grows a page or the batch changes
shape (the kernel reads the old row: a padding 0 or another sequence's page where the
new page should be).
"""
from __future__ import annotations

from .base import Fault, forget_cached_since


class StaleBinding(Fault):
    name = "stale_binding"
    symptom = "garbled text once sequences grow a page: decode reads the previous step's block-table rows"
    cause = "the block-table bind moved after the kernel launch, so each forward reads the last step's table"
    caught_by = "page_table probe: block-table version read (AttentionRead) != version current (stale-binding)"
    fix = "bind before the launch: BatchBuilder.build(bind=True) / BlockTables.bind() before model.forward"
    notebook = "notebooks/stale_binding.ipynb"

    def __init__(self, engine):
        super().__init__(engine)

    def on_enable(self) -> None:
        builder, model = self.engine.builder, self.engine.model
        build, forward = builder.build, model.forward
        self.late_binds = 0
        self._cached_before = dict(self.engine.pool.cached)

        def build_without_bind(scheduled, bind=True, **kw):
            return build(scheduled, bind=False, **kw)          # stages the host table only

        def forward_then_bind(batch, *a, **kw):
            try:
                return forward(batch, *a, **kw)
            finally:                                           # the drifted re-bind
                builder.block_tables.bind()
                self.late_binds += 1

        self.patch(builder, "build", build_without_bind)
        self.patch(model, "forward", forward_then_bind)

    def on_disable(self) -> None:
        # K/V computed while the fault was on is garbled: keep it out of the prefix cache.
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
