"""slow_page_size: the engine re-paged to a page size that is not a power of two.

Field note 8: after a runtime upgrade throughput fell 79 -> 42 tokens/s; the new
kernel path needs page_size a power of two >= 16, and page_size 12 silently fell back
to a slow path. Enabling this fault re-pages an idle engine to page_size 12 (the
`page_size` param) with the same KV memory, as EngineConfig(page_size=12,
allow_unsupported_page_size=True) would build it: new pool, KV cache, block tables and
batch buffers, and get_backend's choice for that size, the generic fallback
(attention/torch_fallback.py). Outputs stay correct; steps get slower. disable()
puts the original pool back, prefix cache included; requests still live at that
point are re-queued and recomputed, like a preemption.
"""
from __future__ import annotations

from .base import Fault


class SlowPageSize(Fault):
    name = "slow_page_size"
    symptom = "throughput halves after an upgrade; outputs unchanged"
    cause = ("page_size is not a power of two: no paged-attention kernel takes it, so attention silently runs a "
             "generic fallback that gathers K/V token by token")
    caught_by = "bandwidth probe: page-size config check (error) and a decode-bandwidth regression against the baseline of the same batch shape"
    fix = "page_size 16, 32, 64 or 128, validated at start-up (EngineConfig rejects anything else)"
    notebook = "notebooks/slow_page_size.ipynb"

    def __init__(self, engine, page_size: int = 12):
        super().__init__(engine, page_size=page_size)
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size

    def on_enable(self) -> None:
        e = self.engine
        if e.has_unfinished():
            raise RuntimeError("slow_page_size re-pages the KV pool: inject it while the engine is idle")
        # The upgrade's engine, built the way EngineConfig(page_size=12, allow_unsupported_page_size=True)
        # builds it: a new stack with the same KV memory (Engine.repage).
        self._original = e.repage(self.page_size, allow_unsupported_page_size=True)

    def on_disable(self) -> None:
        # The original pool comes back, prefix cache included; live requests are recomputed on it.
        self.engine.restore_stack(self._original)
