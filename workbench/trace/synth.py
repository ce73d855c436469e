"""Deterministic prompts for traces that carry only lengths or prefix-block hashes.

Equal hash ids give equal token blocks (the block's tokens are drawn from a generator
seeded by the hash id alone), so the engine's prefix cache sees the sharing the
production trace recorded. Length-only prompts are seeded by the record's position.
"""
from __future__ import annotations

import numpy as np

from .schema import TraceRecord


def _block(seed: int, key: int, n: int, vocab: int, low: int) -> np.ndarray:
    rng = np.random.default_rng([seed, key & 0xFFFFFFFF, key >> 32 & 0xFFFFFFFF])
    return rng.integers(low, vocab, n, dtype=np.int64)


def scaled_length(n: int, scale: float) -> int:
    return max(1, int(round(n * scale))) if n > 0 else 0


def prompt_tokens(rec: TraceRecord, index: int, vocab_size: int, seed: int = 0,
                  length_scale: float = 1.0, max_prompt_len: int | None = None,
                  low_token: int = 3, tokenizer=None) -> list[int]:
    """The prompt of rec as token ids, its lengths scaled (hash blocks scale with it)."""
    if rec.prompt_token_ids is not None:
        ids = list(rec.prompt_token_ids)
    elif rec.prompt_text is not None and tokenizer is not None:
        ids = tokenizer.encode(rec.prompt_text)
    elif rec.hash_ids:
        block = max(1, scaled_length(rec.hash_block_size, length_scale))
        n = scaled_length(rec.prompt_len, length_scale)
        ids = np.concatenate([_block(seed, h, block, vocab_size, low_token) for h in rec.hash_ids])[:n].tolist()
    else:
        ids = _block(seed + 1, index, scaled_length(rec.prompt_len, length_scale), vocab_size, low_token).tolist()
    if max_prompt_len is not None:
        ids = ids[:max_prompt_len]
    return ids or [low_token]
