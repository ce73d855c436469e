"""The layer curve: where, layer by layer, two sides' hidden states part at one token.

For a side we can tap (our engine through a model tap, transformers through forward hooks on its
decoder layers), the residual stream after every layer at the position that computes output token
`t` (teacher-forced on the same tokens; our engine in the same batch composition as the triage, so a
bug that depends on the batch is met again). The curve is, per layer, the relative difference
|h_A - h_B| / |h_A|, of the hidden state and of the attention output (the heads' outputs before
o_proj: a bad read shows there first, where the residual stream may hide it), at the corrupt token and
at the token before it (the pair's numeric difference at a token both sides got right: each layer's
own floor). The first layer whose hidden state or attention output at `t` leaves that floor (FACTOR x, and over MIN_REL) is where the corruption enters; a NaN or inf there
counts as leaving it.
"""
from __future__ import annotations

import numpy as np

from ..engine.taps import ModelTap

FACTOR = 10.0       # a layer whose difference is this many times its own floor has left it
MIN_REL = 1e-4      # relative differences below this are never a layer's departure


class HiddenTap(ModelTap):
    """A model tap (engine.instrumentation.add_tap) that keeps, per layer, the hidden state of the
    row of request `rid` that computes each output token in `tokens` (the last query row of the step
    where the request has that many outputs and is sampled)."""

    # every row's hidden state: the last layer must run for every row, ours may not be sampled first
    needs = frozenset({"attention_out", "every_row_hidden"})

    def __init__(self, rid: int, tokens, num_layers: int):
        self.rid = rid
        self.rows = {int(t): [None] * num_layers for t in tokens}       # hidden state after each layer
        self.attn = {int(t): [None] * num_layers for t in tokens}       # each layer's attention output

    @property
    def done(self) -> bool:
        return all(r[-1] is not None for r in self.rows.values())

    def _row(self, batch):
        for j, s in enumerate(batch.seqs):
            if s.request_id == self.rid:
                if s.num_output_tokens in self.rows and j in batch.sample_seq_idx:
                    return s.num_output_tokens, int(batch.cu_seqlens_q_np[j + 1]) - 1
                return None
        return None

    def on_attention_out(self, layer, o, batch) -> None:
        at = self._row(batch)
        if at is not None:
            self.attn[at[0]][layer] = o[at[1]].reshape(-1).float().cpu().numpy().copy()

    def on_hidden(self, layer, h, batch) -> None:
        at = self._row(batch)
        if at is not None:
            self.rows[at[0]][layer] = h[at[1]].float().cpu().numpy().copy()


def hf_hidden(model, prompt, tokens, at) -> dict:
    """{t: (attention outputs, hidden states)} from transformers: each decoder layer's o_proj input and
    output at the position that
    computes output token t, one forward over prompt + tokens (forward hooks: `output_hidden_states`
    gives the last layer normed)."""
    import torch
    got, attn = [], []

    def keep(_mod, _inp, out):
        got.append((out[0] if isinstance(out, tuple) else out)[0].float().numpy())

    def keep_attn(_mod, inp):                     # o_proj's input: the heads' outputs, concatenated
        attn.append(inp[0][0].float().numpy())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    hooks += [layer.self_attn.o_proj.register_forward_pre_hook(keep_attn) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(prompt) + list(tokens[:max(at)])]))
    finally:
        for h in hooks:
            h.remove()
    i = lambda t: len(prompt) - 1 + t
    return {t: (np.stack([a[i(t)] for a in attn]), np.stack([g[i(t)] for g in got])) for t in at}


def rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-12)
    return np.where(np.isfinite(d), d, np.inf)


def curve_tokens(token: int) -> list[int]:
    """The output tokens a curve at `token` needs: it and the one before (its floor)."""
    return [token - 1, token] if token > 0 else [token]


def curve_from(ha: dict, hb: dict, token: int) -> dict:
    """The layer curve from two sides' hidden states at curve_tokens(token) ({t: (attention outputs,
    hidden states)}: localize.forced_run for our engine, hf_hidden for transformers): {"layer": the first
    layer that leaves its floor (or None), "at": rel per layer at `token`, "floor": rel per layer at the
    token before (zeros for token 0: the prompt's own numerics are then each layer's floor via MIN_REL),
    and the same of the attention outputs}."""
    at, attn_at = rel(ha[token][1], hb[token][1]), rel(ha[token][0], hb[token][0])
    if token > 0:
        floor, attn_floor = rel(ha[token - 1][1], hb[token - 1][1]), rel(ha[token - 1][0], hb[token - 1][0])
    else:
        floor, attn_floor = np.zeros_like(at), np.zeros_like(attn_at)
    # np.inf (a NaN or inf on a side) is never numeric: it leaves any floor, even one the token before
    # already had (a corruption that began before A was sure of a token)
    leaves = lambda x, f: (x > np.maximum(FACTOR * f, MIN_REL)) | np.isinf(x)
    out = np.nonzero(leaves(at, floor) | leaves(attn_at, attn_floor))[0]
    return {"layer": int(out[0]) if len(out) else None, "at": at, "floor": floor, "attn_at": attn_at,
            "attn_floor": attn_floor}
