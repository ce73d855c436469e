"""Sequence: one request's tokens, pages and progress inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int = 0                 # per output token: its log-prob and the top-k (k = this); 0: none
    # Teacher forcing through the serving path: output token i is forced_token_ids[i] whatever the
    # model prefers (the log-probs stay the model's own). Divergence triage runs one engine on
    # another's tokens this way, pages, prefix cache and batching included.
    forced_token_ids: tuple[int, ...] = ()
    # Per prompt position from prompt_logprobs_from on: the log-prob of that prompt token given the
    # ones before it, and the top-k (k = prompt_logprobs; 0: none), as vLLM's prompt_logprobs. Computed
    # by the prefill that runs the prompt (its chunks read the earlier chunks' K/V from the pages);
    # the prefix cache serves no page past prompt_logprobs_from - 1 (those rows must be computed).
    # Teacher forcing a whole continuation in a few prefill steps: divergence triage's fast path.
    prompt_logprobs: int = 0
    prompt_logprobs_from: int = 1

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be an int >= 0 (top-k per token), got {self.logprobs!r}")
        self.forced_token_ids = tuple(self.forced_token_ids)
        for name in ("prompt_logprobs", "prompt_logprobs_from"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name.endswith("from") else 0):
                raise ValueError(f"SamplingParams.{name} must be an int >= {1 if name.endswith('from') else 0}, "
                                 f"got {v!r}")
        bad = [t for t in self.forced_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise ValueError(f"SamplingParams.forced_token_ids must be token ids (ints >= 0), got {bad[:3]!r}")


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int                               # prompt + output never exceeds this
    arrival_time: float = field(default_factory=time.perf_counter)
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)      # prompt + output
    pages: list[int] = field(default_factory=list)          # host page table
    page_generations: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)    # chained hashes of full pages
    hash_chain: list = field(default_factory=list)          # memo: (hash, key) per full page
    num_computed_tokens: int = 0                            # tokens whose KV is in the pages
    num_cached_tokens: int = 0                              # of those, prefix-cache hits
    num_preemptions: int = 0
    last_preemption: tuple = (0, 0)                         # (pages let go, computed tokens dropped)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    user_request_id: object = None                          # the id a caller or trace gave
    generator: object = None                                # torch.Generator of a seeded request
    logprobs: list = field(default_factory=list)            # per output token (params.logprobs > 0): see Sampler
    prompt_logprobs: list = field(default_factory=list)     # per prompt position from params.prompt_logprobs_from

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def page_key(self, i: int, page_size: int) -> tuple:
        """What page i holds, for prefix-cache matching: its tokens."""
        return tuple(self.token_ids[i * page_size:(i + 1) * page_size])

    def page_keys(self, start: int, stop: int, page_size: int) -> list[tuple]:
        """page_key of pages start..stop-1 (the prefix cache hashes them in one go)."""
        return [self.page_key(i, page_size) for i in range(start, stop)]

    def pages_known(self, i: int, page_size: int) -> int:
        """How many of its pages' contents are known when page i's is asked for (the prefix
        cache hashes them in one go): up to page i; later tokens are not generated yet."""
        return i + 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
