"""Where a corruption starts, for a side we can tap (our engine): the layer and the pages.

At the first corrupt token of a request, the side is run again teacher-forced on the same tokens in
the same batch composition, and just before the forward that computes that token's logits the
shadow probe (probes/shadow.py) is asked to check that request through every layer: it recomputes
the request densely from its own tokens (no pages, no cache) and compares, layer by layer, the K/V
stored in its pages and the paged attention output. Its first failing comparison names the layer,
the context position and the page (a bad write, a RoPE slip, or a bad read: block table, page walk,
mask); that is the row's `layer`, `pages` and the end of its evidence. Where the shadow cannot follow
the request's page table (ids outside the pool), the page_table probe, attached too, names the page.
"""
from __future__ import annotations


def localize(engine, prompts, tokens, request: int, token: int) -> dict | None:
    """{"layer", "pages", "kind", "message"} from the shadow's first finding on `request` at `token`,
    or None when it finds nothing there (the corruption is not in what a dense recompute can see)."""
    from ..workbench import Workbench
    from .sides import submit_forced
    nl = engine.model_config.num_layers
    ctx = max(len(p) + len(t) for p, t in zip(prompts, tokens))
    wb = Workbench(engine, log=False).attach("shadow", "page_table",
                                             shadow={"on_demand": True, "budget": ctx * nl + 1})
    shadow = wb.probe("shadow")
    try:
        rid = submit_forced(engine, prompts, tokens)[request]
        asked = False
        while engine.has_unfinished():
            seq = next((s for s in engine.live_sequences() if s.request_id == rid), None)
            if not asked and seq is not None and seq.num_output_tokens == token:
                shadow.check_now(request_id=rid, layer=nl - 1)
                asked = True
            engine.step()
        # the shadow's dense recompute first; a page table the shadow cannot follow (ids outside the pool)
        # is the page_table probe's to name
        found = [f for f in shadow.findings + wb.probe("page_table").findings
                 if f.severity in ("error", "critical") and f.request_id == rid]
    finally:
        wb.detach()
    if not found:
        return None
    f = found[0]
    ev = f.evidence or {}
    pages = sorted({int(x) for x in ev.get("pages", [])} | ({int(f.page)} if f.page is not None else set()))
    return {"layer": f.layer, "pages": pages, "kind": f.kind, "message": f.message, "probe": f.probe,
            "positions": sorted({int(x) for x in ev.get("positions", [])} | ({int(ev["position"])} if "position" in ev
                                                                              else set())),
            "page_size": engine.pool.page_size, "evidence": ev}
