"""Requests in: prompts turned into token ids and checked, and the thread-safe inbox.

add_request and abort may be called from any thread; they only validate and push here. The engine
thread drains the inbox at the start of each step (engine/step.py drain_inbox) and is the only one that
changes the scheduler, the pool or a sequence. A prompt that can never run is rejected before it is
queued (RequestRejected, naming the token or the limit), and the rejection is kept as a notice the
engine thread reports as an event: nothing else changes.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from typing import Any

import torch

from .outputs import RequestRejected


class RequestIntake:
    # Fault seams: `drain` (an intake that drops what it took off the inbox: intake_loses_request).
    FAULT_SEAMS = frozenset({"drain"})

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        # ("add", Sequence) | ("abort", request id), under a lock of its own (held for an append or a
        # pop, never across a step) so that pending() can list it: the request_lifecycle probe's
        # "queued for intake" place is read from here, not from a count the intake keeps.
        self.inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self.notices: queue.SimpleQueue = queue.SimpleQueue()    # (request id, prompt length, why) rejected
        self._ids = itertools.count()
        self._id_lock = threading.Lock()

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Text (tokenized), chat messages (the chat template) or token ids (each checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: pass token ids, not text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: pass token ids, not chat messages")
            return self.tokenizer.apply_chat_template(list(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.vocab_size
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise RequestRejected(f"prompt token {j} is {t!r}: token ids must be ints in [0, {vocab})")
            return ids
        raise RequestRejected(f"a prompt is text, a list of token ids or chat messages, not {type(prompt).__name__}")

    def reject(self, request_id: Any, prompt: Any, why: str) -> None:
        n = len(prompt) if isinstance(prompt, (list, tuple, str)) else 0
        self.notices.put((request_id, n, why))

    def new_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def add(self, seq) -> None:
        with self._inbox_lock:
            self.inbox.append(("add", seq))

    def abort(self, request_id: Any) -> None:
        # The engine issues ids from 0 up: a negative one (generate()'s keys for rejected prompts,
        # score()'s scratch sequences, lock_storm's streams) names nothing to finish, and queueing
        # it would hold has_unfinished() true and EngineIdle off.
        if not (isinstance(request_id, int) and request_id < 0):
            with self._inbox_lock:
                self.inbox.append(("abort", request_id))

    def empty(self) -> bool:
        return not self.inbox

    def pending(self) -> list:
        """The request ids of the adds queued now, in order (a copy, for the lifecycle accounting)."""
        with self._inbox_lock:
            return [item.request_id for kind, item in self.inbox if kind == "add"]

    def drain_notices(self) -> list[tuple]:
        out = []
        while not self.notices.empty():
            out.append(self.notices.get_nowait())
        return out

    def drain(self) -> list[tuple[str, Any]]:
        """What was queued when the call began, no more: submitters that keep the inbox full (a storm
        of add + abort) must not keep the step draining forever."""
        with self._inbox_lock:
            out = list(self.inbox)
            self.inbox.clear()
        return out
