"""generate(): prompts to completion through add_request and step, one output per prompt, in order;
score(): every position's logits of prompts, teacher forced, in one step."""
from __future__ import annotations

from typing import Any, Sequence as Seq

from .outputs import RequestOutput, RequestRejected
from .scheduler import SchedulerOutput
from .sequence import SamplingParams, Sequence
from .step import record_of


def generate(engine, prompts: Seq[Any] | str, params: SamplingParams | Seq[SamplingParams] | None = None,
             progress: bool = False) -> list[RequestOutput]:
    """A prompt the engine can never serve comes back with finish_reason 'rejected' and the reason in
    .error; the others run to completion (a tqdm bar over requests with progress=True)."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    results: dict[int, RequestOutput] = {}
    order = []
    for prompt, p in zip(prompts, plist):
        try:
            order.append(engine.add_request(prompt, p))
        except RequestRejected as e:
            key = -1 - len(order)
            order.append(key)
            results[key] = RequestOutput(key, [], [], True, "rejected", error=str(e))
    pending = {r for r in order if r >= 0}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(pending), desc="generate", unit="req")
    while pending:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                results[out.request_id] = out
                pending.discard(out.request_id)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return [results[r] for r in order]


def score(engine, prompts: Seq[Any]) -> list:
    """Logits at every position of each prompt (teacher forcing), packed into one step, outside the
    scheduler, on pages the KV manager lends; the step is recorded like any other (engine.step_record)."""
    if engine.has_unfinished():
        raise RuntimeError("score() needs an idle engine: finish or abort the running requests first")
    seqs = []
    for i, prompt in enumerate(prompts):
        ids = engine.intake.prompt_ids(prompt)
        engine.validate_prompt(ids)
        seqs.append(Sequence(-1 - i, ids, SamplingParams(), max_len=len(ids) + 1))
    sched = SchedulerOutput(scheduled=[(s, s.num_tokens) for s in seqs])

    def recorded(batch):
        engine.step_record = record_of(engine.step_count, sched, batch, engine.num_pages)
    return engine.runner.score(engine.kv_manager, seqs, on_batch=recorded)
