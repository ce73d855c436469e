"""The two sides of a divergence triage, behind one interface.

A side runs prompts and says, per output position, the log-prob of a given token and its own top
tokens. `run(prompts, max_tokens, forced=None)`: greedy when `forced` is None (the side's own
tokens), else teacher-forced on `forced[i]` (the other side's tokens), through the side's real
serving path, so that a paged-KV bug corrupts what it reads exactly as in production:

  EngineSide  our Engine: SamplingParams(logprobs=k, forced_token_ids=...) through add_request and
              step (pages, prefix cache, batching and all); `batch` and `order` choose the batch
              compositions the noise floor is measured over
  HFSide      a Hugging Face model directory (transformers): one dense forward over prompt + tokens,
              float32, no cache: the reference
  VllmSide    a vLLM server (its OpenAI completions API): greedy through its decode path with its
              sampler's log-probs; teacher-forced by prompt_logprobs over prompt + tokens (its prefill)
  RecordingSide  a flight recording: the tokens production produced, the reference (no log-probs)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Run:
    tokens: list[list[int]]                  # per prompt, the output tokens (the forced ones when forced)
    logprob: list[np.ndarray]                # per prompt, per position: log-prob of that token
    top: list[np.ndarray] = field(default_factory=list)      # per prompt, [positions, k] top token ids
    top_lp: list[np.ndarray] = field(default_factory=list)   # per prompt, [positions, k] their log-probs

    def margin(self, i: int) -> np.ndarray:
        """Top-1 minus top-2 log-prob at each position of prompt i (how sure the side was)."""
        t = self.top_lp[i]
        return t[:, 0] - t[:, 1] if t.shape[1] > 1 else np.full(len(t), np.inf)


def submit_forced(engine, prompts, tokens) -> list[int]:
    """Every prompt teacher-forced on its tokens, added in one go (one batch composition); their
    engine request ids, in prompt order. Localisation re-runs a triage's batch this way."""
    from ..engine.sequence import SamplingParams
    ids = []
    try:
        for p, f in zip(prompts, tokens):
            ids.append(engine.add_request(p, SamplingParams(max_tokens=len(f), ignore_eos=True,
                                                            forced_token_ids=tuple(f))))
    except Exception:
        for r in ids:               # all or nothing: refused part-way, the ones queued are aborted
            engine.abort(r)
        while engine.has_unfinished():
            engine.step()
        raise
    return ids


class EngineSide:
    """Our engine. Greedy through its decode path. Teacher-forced two ways (`forced`):

      "decode"   SamplingParams.forced_token_ids: one forced token a step through the decode path,
                 as production produced them (pages grow a token at a time, the decode kernel reads
                 them); as dear as a greedy run
      "prefill"  SamplingParams.prompt_logprobs over prompt + the tokens: the tokens verified in
                 chunked-prefill steps (each chunk reads the earlier chunks' K/V from the pages),
                 vLLM's prompt_logprobs; the GEMMs at full width, each page read once a chunk
    """

    PATHS = ("decode", "prefill")

    def __init__(self, engine, name: str = "engine", batch: int | None = None, top_k: int = 5,
                 forced: str = "decode"):
        if forced not in self.PATHS:
            raise ValueError(f"EngineSide(forced={forced!r}): one of {self.PATHS}")
        self.engine, self.name, self.batch, self.top_k, self.forced = engine, name, batch, top_k, forced

    def run(self, prompts, max_tokens: int, forced=None, order=None, batch: int | None = None,
            path: str | None = None) -> Run:
        from ..engine.sequence import SamplingParams
        eng = self.engine
        n = len(prompts)
        order = list(order) if order is not None else list(range(n))
        size = batch or self.batch or n
        path = path or self.forced
        verify = forced is not None and path == "prefill"
        out: dict[int, object] = {}
        for start in range(0, n, size):
            ids = {}
            for i in order[start:start + size]:
                f = tuple(forced[i]) if forced is not None else ()
                if verify:
                    p = list(prompts[i])
                    sp = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=self.top_k,
                                        prompt_logprobs_from=len(p))
                    ids[eng.add_request(p + list(f), sp)] = i
                    continue
                sp = SamplingParams(max_tokens=len(f) if f else max_tokens, ignore_eos=True, logprobs=self.top_k,
                                    forced_token_ids=f)
                ids[eng.add_request(prompts[i], sp)] = i
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished and o.request_id in ids:
                        out[ids[o.request_id]] = o
        runs = [out[i] for i in range(n)]
        # verified: the forced tokens are the prompt's tail, scored by its prompt log-probs
        toks = [list(forced[i]) for i in range(n)] if verify else [list(o.token_ids) for o in runs]
        lps = [o.prompt_logprobs if verify else o.logprobs for o in runs]
        return Run(toks, [np.asarray([x[0] for x in lp]) for lp in lps],
                   [np.asarray([x[1] for x in lp]).reshape(len(lp), -1) for lp in lps],
                   [np.asarray([x[2] for x in lp]).reshape(len(lp), -1) for lp in lps])


class HFSide:
    def __init__(self, path, name: str = "transformers", top_k: int = 5):
        import torch
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.name, self.top_k = name, top_k

    def run(self, prompts, max_tokens: int, forced=None, order=None, batch: int | None = None) -> Run:
        import torch
        toks, lps, tops, top_lps = [], [], [], []
        for i, p in enumerate(prompts):
            p = list(p)
            if forced is None:                      # greedy, one token at a time (no cache: the reference)
                seq = list(p)
                for _ in range(max_tokens):
                    with torch.no_grad():
                        logits = self.model(torch.tensor([seq])).logits[0, -1]
                    seq.append(int(logits.argmax()))
                f = seq[len(p):]
            else:
                f = list(forced[i])
            with torch.no_grad():
                logits = self.model(torch.tensor([p + f])).logits[0].float()
            lp = torch.log_softmax(logits[len(p) - 1:len(p) - 1 + len(f)], dim=-1)
            t = lp.topk(self.top_k, dim=-1)
            toks.append(f)
            lps.append(lp[torch.arange(len(f)), torch.tensor(f)].numpy())
            tops.append(t.indices.numpy())
            top_lps.append(t.values.numpy())
        return Run(toks, lps, tops, top_lps)


class VllmSide:
    """A vLLM server through its OpenAI completions API: token ids in, `prompt_logprobs` out.

    Greedy (side A) is vLLM's decode path: temperature 0 with `return_token_ids` and its sampler's
    log-probs (`logprobs`, `return_tokens_as_token_ids`). Teacher forcing (side B, and the repeats)
    is prompt_logprobs over prompt + the forced tokens: vLLM's prefill, its API has no forced
    decode, so a bug only in vLLM's decode path shows when vLLM is side A (its own tokens then go
    wrong where the other side is sure). `batch` requests are in flight at once (vLLM batches
    them), in `order`: the compositions the noise floor is measured over."""

    def __init__(self, url: str, model: str | None = None, name: str = "vllm", top_k: int = 5,
                 timeout_s: float = 300):
        self.url, self.name, self.top_k, self.timeout_s = url.rstrip("/"), name, top_k, timeout_s
        self.model = model or self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> dict:
        import json
        import urllib.request
        with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def _post(self, body: dict) -> dict:
        import json
        import urllib.error
        import urllib.request
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())["choices"][0]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}/v1/completions: HTTP {e.code}: {e.read()[:300]!r}") from None

    def _one(self, p, max_tokens: int, f):
        p = [int(x) for x in p]
        if f is None:                 # greedy: vLLM's decode path, its sampler's own log-probs per token
            c = self._post({"model": self.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, "logprobs": self.top_k,
                            "return_tokens_as_token_ids": True})
            f = [int(x) for x in c["token_ids"]]
            lps = c["logprobs"]
            steps = [{int(k.split(":", 1)[1]): v for k, v in d.items()} for d in lps["top_logprobs"]]
            lp = [float(x) for x in lps["token_logprobs"]]
        else:                         # teacher-forced: prompt_logprobs over prompt + f (vLLM's prefill)
            f = [int(x) for x in f]
            c = self._post({"model": self.model, "prompt": p + f, "max_tokens": 1, "temperature": 0,
                            "prompt_logprobs": self.top_k})
            steps = [{int(k): v["logprob"] for k, v in c["prompt_logprobs"][len(p) + j].items()} for j in range(len(f))]
            lp = [steps[j][tok] for j, tok in enumerate(f)]
        top, top_lp = [], []
        for d in steps:
            best = sorted(d.items(), key=lambda kv: -kv[1])[:self.top_k]
            top.append([k for k, _ in best])
            top_lp.append([v for _, v in best])
        # vLLM writes -inf as -9999 (JSON); a log-prob that low is not finite for the triage
        lp = [x if x > -9999 else -np.inf for x in lp]
        return f, np.asarray(lp), np.asarray(top), np.asarray(top_lp)

    def run(self, prompts, max_tokens: int, forced=None, order=None, batch: int | None = None) -> Run:
        from concurrent.futures import ThreadPoolExecutor
        order = list(order) if order is not None else list(range(len(prompts)))
        with ThreadPoolExecutor(max_workers=batch or len(prompts)) as pool:
            futs = {i: pool.submit(self._one, prompts[i], max_tokens, None if forced is None else forced[i])
                    for i in order}
            res = [futs[i].result() for i in range(len(prompts))]
        return Run([r[0] for r in res], [r[1] for r in res], [r[2] for r in res], [r[3] for r in res])


class RecordingSide:
    """A flight recording (workbench.recorder; our engine's or vLLM's): the prompts and the tokens
    production produced, fixed. It is always the reference (triage's A): it cannot be re-run or
    teacher-forced, and keeps tokens, not log-probs, so the other side judges it alone (triage's
    one-sided rule). Only requests it can stand for: greedy (temperature 0: a sampled token is
    no evidence), finished, with their prompt and output token ids (not a privacy recording);
    the others are listed in `skipped` with the reason."""

    has_logprobs = False

    def __init__(self, path, name: str | None = None, requests=None):
        """requests: only these request ids (as the recording names them); default every one."""
        from ..recorder.reader import open_recording
        self.recording = rec = open_recording(path)
        wanted = None if requests is None else set(requests)
        self.name = name or f"recording {rec.path.name}"
        outs = rec.outputs()
        self.ids, self.prompts, self.tokens, self.skipped = [], [], [], []
        for r in rec.requests:
            rid, o = r.get("id"), outs.get(r.get("id"))
            if wanted is not None and rid not in wanted:
                continue
            temp = (r.get("sampling") or {}).get("temperature", 0.0) or 0.0
            why = ("no prompt token ids (a privacy recording)" if r.get("prompt_token_ids") is None else
                   f"sampled (temperature {temp})" if temp > 0 else
                   "its output is not in the recording" if o is None else
                   "only token counts recorded (privacy)" if o["tokens"] is None else
                   "not finished when the recording ends" if not o["finished"] else
                   "no output tokens" if not o["tokens"] else None)
            if why:
                self.skipped.append({"request": rid, "why": why})
                continue
            self.ids.append(rid)
            self.prompts.append([int(x) for x in r["prompt_token_ids"]])
            self.tokens.append(list(o["tokens"]))
        if not self.ids:
            reasons = sorted({s["why"] for s in self.skipped}) or ["no requests recorded"]
            raise ValueError(f"{rec.path}: no request in this recording can be compared ({'; '.join(reasons)})")

    def run(self, prompts, max_tokens: int, forced=None, order=None, batch: int | None = None) -> Run:
        if forced is not None:
            raise ValueError(f"{self.name}: a recording cannot be teacher-forced (it is the reference side)")
        n = [len(t) for t in self.tokens]
        return Run([list(t) for t in self.tokens], [np.full(k, np.nan) for k in n],
                   [np.zeros((k, 0), dtype=np.int64) for k in n], [np.zeros((k, 0)) for k in n])
