"""Forward progress: requests that wait while the pool has room for them (the Running=0 /
Waiting=N hang reported against vLLM), as one plain function over what the caller reads.

The caller keeps, per request that is not running, the step it last made progress (was
scheduled tokens, or arrived) and how many blocks its next chunk needs; this names those that
have waited `after` steps or more although the free blocks would hold them. The vLLM plugin's
engine side calls it; the judgement is the same whatever engine it watches.
"""
from __future__ import annotations


def stalled(step: int, waiting: dict, free_blocks: int, after: int) -> list[tuple[str, int, int]]:
    """waiting: request -> (last step with progress, blocks it needs). Returns (request, steps
    waited, blocks needed) for each that waited `after` steps or more with room in the pool,
    longest first."""
    out = [(rid, step - since, need) for rid, (since, need) in waiting.items()
           if step - since >= after and need <= free_blocks]
    return sorted(out, key=lambda x: -x[1])
