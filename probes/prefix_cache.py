"""prefix_cache: a shared page must hold the requester's own history, not just equal tokens.

A prefix-cache hit is trusted once the page's tokens match. But a page's K/V depends on
its position (RoPE) and on every token before it: a chain hash that forgets its parent,
a registration under the wrong page index, or a lookup that skips a page serves K/V
computed for another history, and the text garbles with every check on the tokens
passing. This probe keeps its own record of what each cached page holds, independent of
the engine's hash chain:

- on PagesRegistered: the page's true index is where it sits in the registering
  sequence's own page list; the probe stores that index and a CRC chained over the
  sequence's token ids up to the end of the page (zlib.crc32, not the engine's
  hash_page). A registration whose claimed index (the event's, and the pool's
  page_index) differs from the true one, or of a page not yet fully computed, is an error.
- on RequestAdmitted with cached tokens: each hit page j must have been recorded at
  index j with the requester's own CRC of tokens[: (j+1) * page_size]; the pool's
  record (page_index, page_parent = the hash of the requester's page j-1) must agree.
  A mismatch is an error naming both requests and the page.

Cost: one CRC over page_size token ids per registered page and per hit page (the
requester's chain is computed once per admission from one array).
"""
from __future__ import annotations

from typing import Any

from probes.provenance import chain
from workbench.events import PagesRegistered, RequestAdmitted
from workbench.probe import Probe

HINT_HIT = ("the prefix cache served a page computed for another history: a page's key must chain its "
            "parent's hash (hash_page(parent, tokens)) and be registered under its own index "
            "(KVCacheManager.cache_full_pages); flush the prefix cache (engine.reset_prefix_cache()) after the fix")
HINT_REG = ("a page was entered in the prefix cache under another index than the one it holds in the "
            "registering sequence (or before it was full): check KVCacheManager.cache_full_pages")


def history_crcs(tokens, num_pages: int, page_size: int) -> list[int]:
    """CRC32 chained over the token ids of pages 0..num_pages-1 (each entry covers all before it):
    probes/provenance.py's chain, the digest the vLLM plugin's prefix provenance uses too."""
    return chain(tokens, page_size, num_pages)


class PrefixCacheProbe(Probe):
    name = "prefix_cache"
    description = "cached pages checked against the requester's own position and token history"

    def __init__(self, max_records: int = 1_000_000, **params: Any):
        super().__init__(max_records=max_records, **params)
        self.max_records = max_records
        self._rec: dict[int, tuple] = {}     # page -> (index, history crc, registering request, generation)
        self.registrations_checked = 0
        self.hits_checked = 0

    def on_attach(self, engine) -> None:
        self.listen(PagesRegistered, self.on_registered)
        self.listen(RequestAdmitted, self.on_admitted)

    def _seq(self, rid, where) -> Any:
        for s in where:
            if s.request_id == rid:
                return s
        return None

    # ---- registration ----------------------------------------------------------------
    def on_registered(self, e: PagesRegistered) -> None:
        eng = self.engine
        rec = eng.step_record
        seq = self._seq(e.request_id, rec.batch.seqs if rec is not None and rec.batch is not None else ()) or \
            self._seq(e.request_id, eng.live_sequences())
        if seq is None:
            return
        ps = eng.pool.page_size
        where = {p: j for j, p in enumerate(seq.pages)}
        true = [where.get(p, -1) for p in e.pages]
        crcs = history_crcs(seq.token_ids, max(true) + 1 if true else 0, ps)
        gen = eng.pool.generation
        for p, claimed, j in zip(e.pages, e.page_indices, true):
            self.registrations_checked += 1
            pool_claim = eng.pool.page_index[p]
            if j < 0 or claimed != j or pool_claim != j or (j + 1) * ps > seq.num_computed_tokens:
                why = ("it is not in the request's page list" if j < 0 else
                       f"it holds the request's page {j} but was registered as page {claimed} "
                       f"(pool record {pool_claim})" if claimed != j or pool_claim != j else
                       f"its last token is {(j + 1) * ps - 1}, the request has computed only "
                       f"{seq.num_computed_tokens}")
                self.report("error", f"request {seq.request_id}: page {p} entered the prefix cache wrongly: {why}",
                            hint=HINT_REG, kind="prefix-registration", step=e.step, request_id=seq.request_id,
                            page=p, dedup=("prefix-registration", seq.request_id, p),
                            evidence={"page": p, "true_index": j, "claimed_index": claimed,
                                      "pool_index": pool_claim, "computed_tokens": seq.num_computed_tokens})
            if 0 <= j < len(crcs):
                self._rec[p] = (j, crcs[j], seq.request_id, gen[p])
        if len(self._rec) > self.max_records:
            for k in list(self._rec)[: self.max_records // 2]:
                del self._rec[k]

    # ---- hits ----------------------------------------------------------------------------
    def on_admitted(self, e: RequestAdmitted) -> None:
        if e.num_cached_tokens <= 0:
            return
        eng = self.engine
        seq = self._seq(e.request_id, reversed(eng.scheduler.running))
        if seq is None:
            return
        pool, ps = eng.pool, eng.pool.page_size
        hits = seq.pages[: e.num_cached_tokens // ps]
        self.rows.append({"step": e.step, "request_id": e.request_id, "hit_pages": len(hits)})
        if len(self.rows) > 100_000:
            del self.rows[:50_000]
        crcs = history_crcs(seq.token_ids, len(hits), ps)
        for j, p in enumerate(hits):
            self.hits_checked += 1
            rec = self._rec.get(p)
            problems = []
            if rec is not None and rec[3] == pool.generation[p]:
                idx, crc, owner, _ = rec
                if idx != j:
                    problems.append(f"it was computed as page {idx} of request {owner}, here it serves page {j}")
                elif j < len(crcs) and crc != crcs[j]:
                    problems.append(f"request {owner} computed it after other tokens (its history differs from "
                                    f"this request's in pages 0..{j})")
            else:
                owner = None
            if pool.page_index[p] not in (-1, j):
                problems.append(f"the pool registered it as page {pool.page_index[p]}")
            tokens = tuple(seq.token_ids[j * ps:(j + 1) * ps])
            if pool.page_tokens[p] is not None and pool.page_tokens[p] != tokens:
                problems.append("it holds other tokens")
            if j > 0 and pool.page_parent[p] is not None and pool.page_parent[p] != pool.page_hash[hits[j - 1]]:
                problems.append(f"its parent hash is not the hash of the page before it ({hits[j - 1]})")
            if problems:
                self.report(
                    "error", f"request {seq.request_id}: prefix-cache hit on page {p} (its page {j}) is not its own "
                             f"history: {'; '.join(problems)}" + (f" (computed by request {owner})" if owner is not None
                                                                  else ""),
                    hint=HINT_HIT, kind="prefix-history", step=e.step, request_id=seq.request_id, page=p,
                    dedup=("prefix-history", seq.request_id, p),
                    evidence={"page": p, "page_index": j, "computed_by": owner, "problems": problems,
                              "recorded_index": rec[0] if rec else None})
                return                               # one finding per admission: the rest follow from it

    def frame(self):
        """One row per admission with prefix-cache hits: the request and how many pages it reused."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=["step", "request_id", "hit_pages"])
