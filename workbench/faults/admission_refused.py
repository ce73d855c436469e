"""admission_refuses_long_prompts: admission arithmetic that refuses a request the pool could hold.

Reported against vLLM as "Running: 0 reqs, Waiting: N reqs" hangs: a free-block count that
forgets the prefix-cache pages, a reservation never released, a watermark applied twice. The
request at the head of the FCFS queue is refused step after step although the pool has room;
everything behind it waits too; once the running requests finish, nothing runs at all (our
engine then stops with "scheduler stalled"). Here KVCacheManager.try_admit refuses every request
whose prompt is longer than `over` tokens, whatever the pool holds. The same bug planted in
vLLM is the plugin's fault of the same name (workbench/adapters/vllm/faults.py).
"""
from __future__ import annotations

from .base import Fault


class AdmissionRefused(Fault):
    name = "admission_refuses_long_prompts"
    symptom = "a long request never starts, and the queue behind it stalls, while the pool has free pages " \
              "(Running=0 / Waiting=N once the others finish)"
    cause = "admission's free-page arithmetic refuses a request the pool could hold"
    caught_by = "forward_progress probe: request waited N steps unadmitted with room in the pool (warn; error " \
                "when nothing runs)"
    fix = "admit by the pages the first chunk needs against num_free (+ evictable cached pages), once"
    notebook = ""

    def __init__(self, engine, over: int = 120):
        """over: prompts longer than this many tokens are refused."""
        super().__init__(engine, over=over)
        if not isinstance(over, int) or over < 1:
            raise ValueError(f"over={over!r} must be a positive number of tokens")
        self.over = over

    def on_enable(self) -> None:
        kv = self.engine.scheduler.kv
        admit = kv.try_admit
        self.refused: set = set()

        def refusing(seq, budget, reserve_pages=0):
            if len(seq.prompt_token_ids) > self.over:
                self.refused.add(seq.request_id)
                return 0
            return admit(seq, budget, reserve_pages)

        self.patch(kv, "try_admit", refusing)
