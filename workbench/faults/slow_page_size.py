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

from ..engine import instrumentation
from ..engine.attention import get_backend
from ..engine.batch import BatchBuilder
from ..engine.kv_cache import KVCache
from ..engine.kv_manager import KVCacheManager, pages_for
from ..engine.pages import PagePool
from ..engine.scheduler import Scheduler
from ..engine.sequence import SeqStatus
from .base import Fault


class SlowPageSize(Fault):
    name = "slow_page_size"
    symptom = "throughput halves after an upgrade; outputs unchanged"
    cause = ("page_size is not a power of two: no paged-attention kernel takes it, so attention silently runs a "
             "generic fallback that gathers K/V token by token")
    caught_by = "bandwidth probe: page-size config check (error) and a low share of peak bandwidth"
    fix = "page_size 16, 32, 64 or 128, validated at start-up (EngineConfig rejects anything else)"
    notebook = "notebooks/slow_page_size.ipynb"

    def on_enable(self) -> None:
        e = self.engine
        ps = int(self.params.get("page_size", 12))
        if e.has_unfinished():
            raise RuntimeError("slow_page_size re-pages the KV pool: inject it while the engine is idle")
        mc, cfg = e.model_config, e.config
        num_pages = max(1, e.num_pages * cfg.page_size // ps)          # the same KV memory
        pool = PagePool(num_pages, ps, cfg.enable_prefix_caching)
        kv_manager = KVCacheManager(pool, cfg.enable_prefix_caching)
        scheduler = Scheduler(kv_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.watermark)
        scheduler.num_preemptions = e.scheduler.num_preemptions
        kv = KVCache(mc.num_layers, num_pages, ps, mc.num_kv_heads, mc.head_dim, e.kv_dtype, e.device,
                     scaled=getattr(e, "kv_scaled", False))
        with e.lock:
            self.patch(e, "config", cfg.replace(page_size=ps, allow_unsupported_page_size=True))
            self.patch(e, "num_pages", num_pages)
            self.patch(e, "pool", pool)
            self.patch(e, "kv_manager", kv_manager)
            self.patch(e, "scheduler", scheduler)
            self.patch(e, "kv", kv)
            self.patch(e, "builder", BatchBuilder(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                  pages_for(e.max_model_len, ps), ps, e.device))
            self.patch(e, "attn", get_backend(e.device.type, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                              page_size=ps))
            self.patch(e.model_hooks, "kv_bytes_per_page_layer", kv.bytes_per_page // max(1, mc.num_layers))
            self.patch(e, "last_batch", None)
        instrumentation.refresh(e)             # wire the new pool's observer if anyone listens

    def on_disable(self) -> None:
        # Live sequences hold pages of the pool that is about to go: recompute them on the old one.
        e = self.engine
        with e.lock:
            sched = e.scheduler
            live = list(sched.running) + list(sched.waiting)
            for s in live:
                e.kv_manager.release(s)
                s.num_computed_tokens = s.num_cached_tokens = 0
                s.status = SeqStatus.WAITING
            old = next(old for obj, attr, old, _ in self._undo if obj is e and attr == "scheduler")
            old.num_preemptions = sched.num_preemptions
            old.waiting.extendleft(reversed(live))

    def disable(self) -> None:
        super().disable()
        instrumentation.refresh(self.engine)
