"""What the engine hands back: one RequestOutput per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """A request the engine can never serve (too long, empty, bad token ids); nothing was changed."""


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None        # stop | length | abort | rejected
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # SamplingParams.logprobs > 0: per output token (log-prob of the token, top-k ids, top-k log-probs)
    logprobs: list | None = None
    # SamplingParams.prompt_logprobs > 0: per prompt position from prompt_logprobs_from on, the same
    # triple for that prompt token given the ones before it
    prompt_logprobs: list | None = None
    _tokenizer: object = field(default=None, repr=False, compare=False)
    _text: str | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        """The generated tokens as text (decoded on first access; '' without a tokenizer)."""
        if self._text is None:
            self._text = self._tokenizer.decode(self.token_ids) if self._tokenizer is not None else ""
        return self._text


def request_output(seq, tokenizer=None) -> RequestOutput:
    """What the engine hands back for seq now (a copy: later steps do not change it)."""
    return RequestOutput(
        request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids), finished=seq.is_finished,
        finish_reason=seq.finish_reason, num_preemptions=seq.num_preemptions,
        num_cached_tokens=seq.num_cached_tokens, arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time, finish_time=seq.finish_time,
        logprobs=list(seq.logprobs) if seq.params.logprobs else None,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs else None,
        _tokenizer=tokenizer)
