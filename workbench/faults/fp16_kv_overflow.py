"""fp16_kv_overflow: one layer's K and V grow past fp16's 65504; the fp16 KV cache stores inf.

Production (field note 5): a larger model answered `<unk>` and garbage in fp16 while a
small one was fine and training loss looked perfect. Its K/V simply are large in some
layers. The fault gives one layer that property without changing what the model
computes: k_proj and v_proj rows are multiplied by `factor` and q_proj / o_proj divided
by it, so q.k and o_proj(attention(v)) are unchanged. With a power-of-two factor the
float32 model is bit-identical; only the cast into a float16 KV cache breaks: K/V
become inf, decode attention over them returns NaN, the logits are NaN and argmax
picks token 0 (`<unk>` / `<|endoftext|>` in most vocabularies), then garbage.
kv_cache_dtype="fp16_scaled" stores the same values with a scale per page and answers
like float32.

The layer's fused Linear objects are swapped (their weights may be oneDNN-prepacked)
and put back on exit. Pages registered in the prefix cache while it was on leave the
cache on exit (their K/V belong to the rescaled layer); the layer's cache is scrubbed
of inf/NaN, which attention would otherwise pick up from masked slots of reused pages.
"""
from __future__ import annotations

import math

import torch

from ..engine.linear import Linear
from ..engine.model import rms_norm
from .base import Fault, forget_cached_since

FP16_MAX = 65504.0


def dense_weight(lin: Linear) -> torch.Tensor:
    """The [out, in] weight of a Linear, whichever layouts (oneDNN-prepacked, skinny) hold it."""
    return lin.dense_weight()


class FP16KVOverflow(Fault):
    name = "fp16_kv_overflow"
    symptom = "a larger model answers <unk> / garbage in fp16 while fp32 (and a small model) are fine"
    cause = "one layer's K/V exceed 65504; casting them into the float16 KV cache stores inf, attention returns NaN"
    caught_by = "fp16_overflow"
    fix = 'EngineConfig(kv_cache_dtype="fp16_scaled") (a scale per page) or a bfloat16 KV cache'
    notebook = "notebooks/fp16_kv_overflow.ipynb"

    def __init__(self, engine, layer: int | None = None, factor: float | None = None,
                 overshoot: float = 4.0):
        """layer: default the middle layer. factor: K/V multiplier, rounded to a power of two;
        default the one that puts a typical token's K/V absmax at `overshoot` x 65504."""
        super().__init__(engine, layer=layer, factor=factor, overshoot=overshoot)
        n = engine.model_config.num_layers
        self.layer = n // 2 if layer is None else layer
        if not 0 <= self.layer < n:
            raise ValueError(f"layer={self.layer} is not in [0, {n})")
        self.overshoot = overshoot
        self.requested_factor = factor
        self.factor: float | None = None

    def typical_kv_absmax(self) -> float:
        """Median per-token K/V absmax of the layer on unit-RMS inputs (the rms-normed stream)."""
        m = self.engine.model
        L = m.layers[self.layer]
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(64, m.cfg.hidden_size, generator=g).to(m.device, m.dtype)
        with torch.inference_mode():
            kv = L.qkv(rms_norm(x, L.norm_attn, m.cfg.rms_norm_eps))[:, m.q_size:]
        return float(kv.float().abs().amax(dim=1).median())

    def on_enable(self) -> None:
        eng, m = self.engine, self.engine.model
        L = m.layers[self.layer]
        f = self.requested_factor or self.overshoot * FP16_MAX / max(self.typical_kv_absmax(), 1e-30)
        self.factor = f = 2.0 ** max(1, round(math.log2(f)))   # power of two: the rescale is exact
        q, kv = m.q_size, 2 * m.kv_size
        rows = torch.cat([torch.full((q,), 1 / f), torch.full((kv,), f)]).to(m.device, torch.float32)
        w = (dense_weight(L.qkv).float() * rows[:, None]).to(L.qkv.dtype)
        b = None if L.qkv.bias is None else (L.qkv.bias.float() * rows).to(L.qkv.bias.dtype)
        wo = (dense_weight(L.o).float() / f).to(L.o.dtype)
        kw = {"backend": eng.config.linear_backend}      # the engine's linears' path, not the process default
        self.patch(L, "qkv", Linear(w.contiguous(), b, compute_dtype=L.qkv.compute_dtype, **kw))
        self.patch(L, "o", Linear(wo.contiguous(), L.o.bias, compute_dtype=L.o.compute_dtype, **kw))
        # Pages computed now hold the rescaled layer's K/V: they leave the prefix cache on disable.
        self._cached_before = dict(eng.pool.cached)

    def on_disable(self) -> None:
        # K/V computed while the fault was on belongs to the rescaled layer: out of the prefix cache.
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
        kv = self.engine.kv
        for t in (kv.k[self.layer], kv.v[self.layer]):
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
