"""The shadow probe's findings: where a wrong K/V or a wrong attention output came from, in words.

A mixin of ShadowProbe (shadow.py): once the dense recompute disagrees with what the engine stored
or computed, these name the token, its page and slot, whether K was stored rotated at another
position, where the right K/V did land (another slot), or which shifted causal mask reproduces a
wrong read, and report it with the hint for that kind of bug.
"""
from __future__ import annotations

import math

import torch

from workbench.engine.model import rope_tables

from .attention_math import mask_shift

HINT_WRITE = ("the K/V at this token's slot are not the ones computed for it: check slot_mapping "
              "(slot = seq.pages[pos // page_size] * page_size + pos % page_size) and the store in "
              "write_kv / rope_write")
HINT_ROPE = ("K was stored rotated at another position: check batch.positions (num_computed_tokens + "
             "offset in the chunk) and the cos/sin rows RoPE reads")
HINT_READ = ("the pages hold the right K/V but attention over them is wrong: check the block table rows "
             "the kernel reads, its page walk (context length, page index), the causal mask (bottom-right "
             "aligned over the context), cu_seqlens, and the positions RoPE used for q")
HINT_OLD = ("; or no bad write at all: the value was computed from a bad read in an earlier layer in the step "
            "that ran this token (the layers below hold the right K/V, so check that step's reads too)")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class ShadowFindings:
    def _where(self, seq, pos: int) -> tuple[int, dict]:
        ps = self.engine.kv.page_size
        page = int(seq.pages[pos // ps])
        return page, {"position": pos, "token_id": int(seq.token_ids[pos]), "page": page,
                      "page_index": pos // ps, "offset": pos % ps,
                      "user_request_id": getattr(seq, "user_request_id", None)}

    def _rotated_at(self, raw: torch.Tensor, got: torch.Tensor, pos: int, tol: float) -> int | None:
        """The position (within 4 of pos) at which `raw` rotated by RoPE comes closest to `got`, if close."""
        cos, sin = rope_tables(raw.shape[-1], pos + 5, self.engine.model_config.rope_theta)
        norm = got.abs().amax().clamp_min(1e-30)
        err = {pos + d: float((_rope(raw, cos[pos + d].to(raw.device), sin[pos + d].to(raw.device)) - got)
                              .abs().amax() / norm) for d in range(-4, 5) if d and pos + d >= 0}
        at = min(err, key=err.get)
        return at if err[at] <= tol else None

    def _report_write(self, p, l, pos, ek, ev, tol, k, v, what, wrong=None, maybe_read=False) -> None:
        seq, rid = p["seq"], p["seq"].request_id
        page, ev_ = self._where(seq, pos)
        ev_.update(layer=l, k_err=float(ek), v_err=float(ev), tolerance=tol, this_step=pos >= p["start"],
                   maybe_read=maybe_read, **({"positions_wrong": wrong} if wrong is not None else {}),
                   **self._find_slot(l, k[pos], v[pos], tol))
        went = (f"; they are at page {ev_['found_at_page']}, offset {ev_['found_at_offset']} instead"
                if "found_at_page" in ev_ else "")
        self.report("error", f"request {rid}, layer {l}, position {pos} (page {page}, offset {ev_['offset']}): "
                             f"{what} (error K {float(ek):.3g}, V {float(ev):.3g} x max, tolerance {tol:.1g}){went}: "
                             f"a bad write" + (", or a bad read when it ran" if maybe_read else ""),
                    HINT_WRITE + (HINT_OLD if maybe_read else ""), kind="shadow-kv-write",
                    dedup=("shadow-kv-write", rid, l), step=p["step"], request_id=rid, layer=l, page=page,
                    evidence=ev_)

    def _report_rope(self, p, l, pos, at, which, err, tol) -> None:
        seq, rid = p["seq"], p["seq"].request_id
        page, ev_ = self._where(seq, pos)
        ev_.update(layer=l, tensor=which, err=float(err), tolerance=tol, rotated_at_position=at)
        self.report("error", f"request {rid}, layer {l}, position {pos} (page {page}): {which} was rotated at "
                             f"position {at}" + ("; V is right" if which == "K" else "") + ": a RoPE position slip",
                    HINT_ROPE, kind="shadow-rope", dedup=("shadow-rope", rid, l), step=p["step"], request_id=rid,
                    layer=l, page=page, evidence=ev_)

    def _find_slot(self, l, k_t, v_t, tol, chunk: int = 4096) -> dict:
        """Where in layer l's cache the token's K/V went (a write into the wrong slot), if anywhere."""
        kc, vc = self.engine.kv.k[l], self.engine.kv.v[l]
        n, ps = kc.shape[:2]
        nk, nv = k_t.abs().amax().clamp_min(1e-30), v_t.abs().amax().clamp_min(1e-30)
        best, slot = math.inf, -1
        for a in range(0, n, chunk):                    # pages in chunks: a big pool is not copied at once
            pg = torch.arange(a, min(n, a + chunk), device=kc.device)
            ks, vs = self._stored(kc, pg, len(pg) * ps), self._stored(vc, pg, len(pg) * ps)
            err = torch.maximum((ks - k_t).abs().amax((1, 2)) / nk, (vs - v_t).abs().amax((1, 2)) / nv)
            i = int(err.argmin())
            if float(err[i]) < best:
                best, slot = float(err[i]), a * ps + i
        if best > tol:
            return {}
        return {"found_at_slot": slot, "found_at_page": slot // ps, "found_at_offset": slot % ps}

    def _mask_diagnosis(self, p, got, qe, ks, vs, tol, scale) -> str | None:
        """Does the paged output match attention under a causal mask shifted by one?"""
        found = mask_shift(qe, got, ks, vs, torch.arange(p["start"], p["ctx"], device=ks.device), scale, tol)
        return None if found is None else found[0]

    def _report_read(self, p, l, err, tol, what, diagnosis=None) -> None:
        seq, rid, start = p["seq"], p["seq"].request_id, p["start"]
        r = int(torch.nonzero(err > tol)[0])
        page, ev_ = self._where(seq, start + r)
        ev_.update(layer=l, err=float(err[r]), max_err=float(err.max()), tolerance=tol,
                   rows_wrong=int((err > tol).sum()), rows=int(err.shape[0]), query_start=start,
                   context=p["ctx"], reads_pages=p["ctx"] > p["n"])
        if diagnosis:
            ev_["matches"] = diagnosis
        self.report("error", f"request {rid}, layer {l}: {what}, from position {start + r} on (page {page}; error "
                             f"{float(err[r]):.3g} x max, tolerance {tol:.1g}, {ev_['rows_wrong']}/{ev_['rows']} rows)"
                             + (f"; it matches a {diagnosis}" if diagnosis else ""),
                    HINT_READ, kind="shadow-attention", dedup=("shadow-attention", rid, l), step=p["step"],
                    request_id=rid, layer=l, page=page, evidence=ev_)

    # ---- views ---------------------------------------------------------------------------------
