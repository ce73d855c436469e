"""Where a corruption starts, for a side we can tap (our engine): the layer and the pages, in one re-run.

At the first corrupt token t of a request, the side is run again teacher-forced on the same tokens in
the same batch composition, up to the step that computes t (the rest is then aborted). That one run
feeds both views of it:
- a HiddenTap (layers.py) keeps the request's hidden state and attention output after every layer at
  t-1 and t: the layer curve's input;
- just before the forward that computes t, the shadow probe (probes/shadow.py) is asked to check that
  request through every layer: it recomputes the request densely from its own tokens (no pages, no
  cache) and compares, layer by layer, the K/V stored in its pages and the paged attention output. Its
  first failing comparison names the layer, the context position and the page (a bad write, a RoPE
  slip, or a bad read: block table, page walk, mask); that is the row's `layer`, `pages` and the end
  of its evidence. Where the shadow cannot follow the request's page table (ids outside the pool), the
  page_table probe, attached too, names the page.
"""
from __future__ import annotations

import numpy as np


def forced_run(engine, prompts, tokens, request: int, at, shadow: bool = True) -> tuple[dict, dict | None]:
    """(hidden, found): hidden = {t: (attention outputs [layers, heads x head_dim], hidden states
    [layers, hidden])} for `request` at each output token t in `at`; found = the shadow's (or the
    page_table probe's) first finding on `request` at max(at), or None (also with shadow=False)."""
    import probes as registry
    from ..engine.instrumentation import add_tap, remove_tap
    from .layers import HiddenTap
    from .sides import submit_forced
    nl = engine.model_config.num_layers
    token = max(at)
    wb = tap = None
    ids: list[int] = []
    found = []
    try:                    # whatever fails (a prompt rejected, a step), the probes and the tap come off
        if shadow:
            ctx = max(len(p) + len(t) for p, t in zip(prompts, tokens))
            # the two probes on their own (this module sits below the Workbench facade)
            wb = {"shadow": registry.probe_class("shadow")(on_demand=True, budget=ctx * nl + 1).attach(engine),
                  "page_table": registry.probe_class("page_table")().attach(engine)}
        ids = submit_forced(engine, prompts, tokens)
        rid = ids[request]
        tap = HiddenTap(rid, at, nl)
        add_tap(engine, tap)
        asked = wb is None
        while engine.has_unfinished() and not tap.done:
            if not asked:
                seq = next((s for s in engine.live_sequences() if s.request_id == rid), None)
                if seq is not None and seq.num_output_tokens == token:
                    wb["shadow"].check_now(request_id=rid, layer=nl - 1)
                    asked = True
            engine.step()
        if wb is not None:
            # the shadow's dense recompute first; a page table the shadow cannot follow (ids outside the
            # pool) is the page_table probe's to name
            found = [f for f in wb["shadow"].findings + wb["page_table"].findings
                     if f.severity in ("error", "critical") and f.request_id == rid]
    finally:
        if tap is not None:
            remove_tap(engine, tap)
        if wb is not None:
            for p in wb.values():
                p.detach()
        for r in ids:
            engine.abort(r)
        while ids and engine.has_unfinished():      # the aborts take effect at the next step
            engine.step()
    missing = [t for t, rows in tap.rows.items() if any(r is None for r in rows + tap.attn[t])]
    if missing:
        raise RuntimeError(f"request {request}: no step computed its token(s) {missing}")
    hidden = {t: (np.stack(tap.attn[t]), np.stack(rows)) for t, rows in tap.rows.items()}
    return hidden, (_as_fault(found[0], engine) if found else None)


def _as_fault(f, engine) -> dict:
    ev = f.evidence or {}
    pages = sorted({int(x) for x in ev.get("pages", [])} | ({int(f.page)} if f.page is not None else set()))
    return {"layer": f.layer, "pages": pages, "kind": f.kind, "message": f.message, "probe": f.probe,
            "engine_request_id": f.request_id,
            "positions": sorted({int(x) for x in ev.get("positions", [])} | ({int(ev["position"])} if "position" in ev
                                                                              else set())),
            "page_size": engine.pool.page_size, "evidence": ev}
