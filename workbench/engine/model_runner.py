"""ModelRunner: a step's inputs, forward and sampling, behind the two calls every runner answers.

    prepare(sched) -> PackedBatch | None    the step's inputs (the packed batch, block tables bound)
    execute(sched, batch) -> ModelRunnerOutput
                                            forward and sample: per sampled sequence its token

The engine calls prepare, tells its listeners what was packed, then execute, and hands the output to
Scheduler.update_from_output; the simulator (trace/simulate.py) makes the same calls on its cost model,
whose one input is the step's token count and which computes no tokens. Under tensor parallel the model is the driver's rank-0
shard, whose forward runs the step protocol on every rank (parallel/driver.py): same runner.

The runner computes; it changes no request's state (the scheduler applies the output) and emits
nothing (the engine does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import PackedBatch
from .sampler import Sampler
from .sequence import Sequence


@dataclass
class ModelRunnerOutput:
    sampled: list[Sequence] | None    # sequences whose whole context is computed: each produced a token
    tokens: list[int] | None          # their tokens; None from a cost model (counted, never known)
    logprobs: dict | None = None      # row of sampled -> (log-prob, top ids, top log-probs), if asked
    prompt_logprobs: list | None = None   # (sequence, first position, entries) for prompt_logprobs
    seconds: float = 0.0              # a cost model's step time (a real forward is timed by its caller)


class ModelRunner:
    def __init__(self, model, sampler: Sampler):
        self.model, self.sampler = model, sampler
        self.builder = self.kv = self.attn = None

    def install(self, stack) -> None:
        """Run on stack's builder, KV tensors and attention backend (the engine's, after a repage too)."""
        self.builder, self.kv, self.attn = stack.builder, stack.kv, stack.attn

    def prepare(self, sched) -> PackedBatch:
        return self.builder.build(sched.scheduled)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        return self.model.forward(batch, self.kv, self.attn)

    def execute(self, sched, batch: PackedBatch) -> ModelRunnerOutput:
        logits = self.forward(batch)
        sampled = [batch.seqs[i] for i in batch.sample_seq_idx]
        prompt_lps = None
        if batch.prompt_logprob_spans:                # their rows follow the sampled rows
            prompt_lps = self.sampler.prompt_logprobs(logits[len(sampled):], batch.prompt_logprob_spans)
            logits = logits[:len(sampled)]
        if not sampled:
            return ModelRunnerOutput([], [], None, prompt_lps)
        tokens = self.sampler(logits, sampled)
        lps = self.sampler.logprobs(logits, sampled, tokens) if self.sampler.wants_logprobs(sampled) else None
        return ModelRunnerOutput(sampled, tokens, lps, prompt_lps)

    def score(self, kv_manager, seqs: list[Sequence], on_batch=None) -> list[torch.Tensor]:
        """Logits at every position of each sequence, packed into one step on pages the KV manager
        lends for it (every row computed: no prefix-cache hit) and takes back. on_batch(batch):
        called once the batch is packed, before the forward (the engine records it)."""
        taken = []
        try:
            for s in seqs:
                kv_manager.allocate_fresh(s)
                taken.append(s)
            batch = self.builder.build([(s, s.num_tokens) for s in seqs], all_logits=True)
            if on_batch is not None:
                on_batch(batch)
            logits = self.forward(batch)
        finally:
            for s in taken:
                kv_manager.release(s)
        cu = batch.cu_seqlens_q_np
        return [logits[cu[i]:cu[i + 1]] for i in range(len(seqs))]
