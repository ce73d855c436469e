"""Prefix provenance on vLLM's engine core: each hit checked against what its blocks were filled with.

A mixin of PoolWatch (engine_side.py): at schedule time, every new or resumed request's prefix-cache
hit blocks are checked against probes/provenance.py's ledger (a digest of the token history each
block was filled for, with what else changes K/V: the LoRA, the cache salt), and the blocks this
step fills are recorded. Per KV cache group the ledger models.
"""
from __future__ import annotations

from probes.provenance import ProvenanceLedger, chain, seed

from . import sanitizer
from .ledger import whole_lists


class ProvenanceCheck:
    def _provenance(self, scheduler, so, added=()) -> None:
        """Hits checked against what the blocks were filled with; blocks this step fills recorded.
        At schedule time: vLLM has already counted this step's tokens as computed, and the step's
        forward writes their K/V. Per KV cache group the ledger models (a sliding window's hit
        starts with vLLM's null block for the tokens behind the window: those are not read)."""
        if getattr(scheduler, "connector", None) is not None:
            return                    # a connector's loaded tokens count as computed but were not hits
        hits = [(rid, computed) for rid, _, computed in whole_lists(so)]
        scheduled = getattr(so, "num_scheduled_tokens", None) or {}
        groups = scheduler.kv_cache_config.kv_cache_groups
        found = []
        for g, rule in enumerate(self.rules):
            if rule is not None:
                found += self._provenance_group(scheduler, g, int(groups[g].kv_cache_spec.block_size), hits,
                                                scheduled, added)
        if found:
            self.rep.findings(found, key=lambda f: ("provenance", f["request_id"], f["page"]))

    def _provenance_group(self, scheduler, g: int, bs: int, hits, scheduled, added) -> list[dict]:
        prov = self.prov.get(g)
        if prov is None:
            prov = self.prov[g] = ProvenanceLedger(bs)
        null = self.ledger.null
        hit_blocks = set()
        for rid, computed in hits:
            entry = self.ledger.reqs.get(rid)
            if entry is not None and g < len(entry.groups):
                hit_blocks.update(entry.groups[g][:computed // bs])
        for b in added:                               # handed out afresh: what it held before is gone
            if b not in hit_blocks:
                prov.rec.pop(b, None)
        found = []
        for rid, computed in hits:
            req, entry = scheduler.requests.get(rid), self.ledger.reqs.get(rid)
            if req is None or entry is None or g >= len(entry.groups) or getattr(req, "mm_features", None):
                continue              # multimodal hashes key only the blocks they overlap: not modelled
            k = computed // bs
            tokens = req.all_token_ids
            start = seed(_extra_keys(req))
            digests = chain(tokens, bs, k, start)
            if k:
                m = prov.check_hit(rid, entry.groups[g][:k], tokens, digests)
                if m is not None:
                    f = sanitizer.provenance_finding(self.step + 1, m, bs)
                    f["evidence"]["kv_cache_group"] = g
                    found.append(f)
            self.crc[(rid, g)] = (len(digests), digests[-1] if digests else start)
        requests, crcs = scheduler.requests, self.crc
        for rid in scheduled:
            req = requests.get(rid)
            if req is None:
                continue
            done, crc = crcs.get((rid, g)) or (0, None)
            if req.num_computed_tokens < (done + 1) * bs:
                continue                      # no block completed since the last fill: most rows of a decode step
            entry = self.ledger.reqs.get(rid)
            if entry is None or g >= len(entry.groups) or getattr(req, "mm_features", None):
                continue
            blocks = entry.groups[g]
            tokens = req.all_token_ids
            full = min(int(req.num_computed_tokens), len(tokens)) // bs
            if full <= done or done > len(blocks):
                continue
            if crc is None:
                crc = seed(_extra_keys(req))
            new = chain(tokens[done * bs:full * bs], bs, full - done, crc)
            for i, dg in enumerate(new):
                j = done + i
                if j < len(blocks) and blocks[j] != null:
                    prov.fill(blocks[j], j, dg, tokens, rid)
            self.crc[(rid, g)] = (done + len(new), new[-1] if new else crc)
        return found


def _extra_keys(req) -> tuple:
    """What besides the tokens changes a block's K/V: the LoRA, the cache salt, multimodal inputs."""
    lora = getattr(req, "lora_request", None)
    mm = tuple(getattr(f, "identifier", None) or getattr(f, "mm_hash", None) for f in (getattr(req, "mm_features", None)
                                                                                      or ()))
    return (getattr(lora, "lora_name", None), getattr(req, "cache_salt", None), *mm)
