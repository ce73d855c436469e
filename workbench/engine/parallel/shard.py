"""How a Llama-family model is cut across tensor-parallel ranks, and the layers that talk.

The split (Megatron-style, as vLLM's): q|k|v and gate/up are column-parallel (each rank
computes its own heads and its own slice of the MLP's intermediate rows), o and down are
row-parallel (each rank multiplies its slice of the inputs; an all-reduce sums the partial
outputs), the vocabulary projection is split by vocabulary rows and its logits gathered on
rank 0, which samples. The embedding and the norms are replicated.

**Heads go to ranks in whole GQA groups.** A query head reads one KV head; a rank that holds a
query head must hold its KV head, and paged-attention kernels (and our backends) take a
uniform group size on a rank. So the KV heads are split into contiguous, nearly equal runs
(sizes differing by at most one), and every rank takes the query heads of its KV heads.
SmolLM2-135M has 9 query heads and 3 KV heads (group of 3):

    TP=2: rank 0 KV heads 0-1 (query heads 0-5), rank 1 KV head 2 (query heads 6-8): [6, 3]
    TP=3: one KV head and three query heads each: [3, 3, 3]
    TP>3: a ConfigError: there is no fourth KV head to give (replicating KV heads, as vLLM
          does when tp > num_kv_heads, is not implemented)

An even [5, 4] split of the query heads would cut KV head 1's group in two (both ranks
need it, and one rank would hold 5 query heads over 2 KV heads: no uniform group).

**The MLP evens the ranks out.** With uneven heads, rank 0 holds twice rank 1's attention
weights; the intermediate rows are split so that every rank streams about the same weight
bytes per layer (rounded to multiples of 16): SmolLM2 at TP=2 gets 688 / 848 of 1536 rows,
1.78 / 1.76 M weights per layer. Decode is bound by weight streaming, so equal bytes is
equal step time. The vocabulary is split evenly (49152 / 2).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ConfigError
from ..linear import Linear
from ..model import LlamaModel
from ..model_config import ModelConfig

ALIGN = 16                   # intermediate rows per rank in multiples of this (when they divide)


@dataclass(frozen=True)
class ShardPlan:
    """Per rank: [start, end) of its KV heads, query heads, MLP rows and vocabulary rows."""
    world: int
    kv_heads: tuple[tuple[int, int], ...]
    q_heads: tuple[tuple[int, int], ...]
    mlp_rows: tuple[tuple[int, int], ...]
    vocab_rows: tuple[tuple[int, int], ...]

    def sizes(self, what: str) -> list[int]:
        return [b - a for a, b in getattr(self, what)]

    def describe(self) -> str:
        return (f"query heads {self.sizes('q_heads')}, KV heads {self.sizes('kv_heads')}, "
                f"MLP rows {self.sizes('mlp_rows')}, vocabulary rows {self.sizes('vocab_rows')}")


def _runs(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    out, a = [], 0
    for n in sizes:
        out.append((a, a + n))
        a += n
    return tuple(out)


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def plan_shards(mc: ModelConfig, world: int) -> ShardPlan:
    """The split of mc over `world` ranks; a ConfigError naming the values when there is none."""
    if world < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {world}")
    hq, hkv = mc.num_heads, mc.num_kv_heads
    if world > hkv:
        ok = ", ".join(str(n) for n in range(1, hkv + 1))
        raise ConfigError(
            f"tensor_parallel_size={world} cannot split this model's {hkv} KV heads ({hq} query heads, groups of "
            f"{hq // hkv}): every rank needs whole GQA groups, at least one KV head each (replicating KV heads is "
            f"not implemented); use tensor_parallel_size in {ok}")
    group = hq // hkv
    kv = _even(hkv, world)
    q = [n * group for n in kv]
    # MLP rows: every rank streams the same weight bytes per layer (attention + MLP).
    h, d, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
    attn = [(qn + 2 * kn) * d * h + h * qn * d for qn, kn in zip(q, kv)]
    per_row = 3 * h
    total = sum(attn) + inter * per_row
    want = [(total / world - a) / per_row for a in attn]
    align = ALIGN if inter % ALIGN == 0 and inter // ALIGN >= world else 1
    rows = [max(align, int(round(w / align)) * align) for w in want[:-1]]
    rows.append(inter - sum(rows))
    if rows[-1] < 1 or min(rows) < 1:
        rows = _even(inter, world)
    vocab = _even(mc.vocab_size, world)
    return ShardPlan(world, _runs(kv), _runs(q), _runs(rows), _runs(vocab))


def shard_config(mc: ModelConfig, plan: ShardPlan, rank: int) -> ModelConfig:
    """The model config of one rank's shard: its heads and MLP rows (the vocabulary head is its own,
    so untied); hidden size, layers, vocabulary (the embedding is replicated) stay the model's."""
    return replace(mc, num_heads=plan.sizes("q_heads")[rank], num_kv_heads=plan.sizes("kv_heads")[rank],
                   intermediate_size=plan.sizes("mlp_rows")[rank], tie_word_embeddings=False)


def shard_state_dict(sd: dict, mc: ModelConfig, plan: ShardPlan, rank: int) -> dict:
    """The tensors rank `rank` holds, by the names LlamaModel reads (views: no copy until the model's)."""
    d = mc.head_dim
    q0, q1 = plan.q_heads[rank]
    k0, k1 = plan.kv_heads[rank]
    i0, i1 = plan.mlp_rows[rank]
    v0, v1 = plan.vocab_rows[rank]
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"], "model.norm.weight": sd["model.norm.weight"]}
    head = sd.get("lm_head.weight")
    if head is None or mc.tie_word_embeddings:
        head = sd["model.embed_tokens.weight"]
    out["lm_head.weight"] = head[v0:v1]
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = sd[p + "self_attn.q_proj.weight"][q0 * d:q1 * d]
        out[p + "self_attn.k_proj.weight"] = sd[p + "self_attn.k_proj.weight"][k0 * d:k1 * d]
        out[p + "self_attn.v_proj.weight"] = sd[p + "self_attn.v_proj.weight"][k0 * d:k1 * d]
        if mc.attention_bias:
            out[p + "self_attn.q_proj.bias"] = sd[p + "self_attn.q_proj.bias"][q0 * d:q1 * d]
            out[p + "self_attn.k_proj.bias"] = sd[p + "self_attn.k_proj.bias"][k0 * d:k1 * d]
            out[p + "self_attn.v_proj.bias"] = sd[p + "self_attn.v_proj.bias"][k0 * d:k1 * d]
        out[p + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"][:, q0 * d:q1 * d]
        out[p + "mlp.gate_proj.weight"] = sd[p + "mlp.gate_proj.weight"][i0:i1]
        out[p + "mlp.up_proj.weight"] = sd[p + "mlp.up_proj.weight"][i0:i1]
        out[p + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"][:, i0:i1]
        out[p + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


class RowParallelLinear:
    """A row-parallel projection (o, down): this rank's partial product, summed over the ranks.

    add(x, residual): rank 0 adds the residual inside its GEMM (the fused epilogue of one
    device); the other ranks contribute their partial product alone; the all-reduce then
    gives every rank residual + the full projection, bit for bit the same on all of them."""

    def __init__(self, inner: Linear, group, owns_residual: bool):
        self.inner, self.group, self.owns_residual = inner, group, owns_residual

    def __getattr__(self, name):          # numel, nbytes, backend, weight, ...: the shard's
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        self.group.all_reduce(y)
        return y

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        y = self.inner.add(x, other) if self.owns_residual else self.inner(x)
        self.group.all_reduce(y)
        return y


class VocabParallelHead:
    """The vocabulary projection split by rows: each rank its logits, gathered on rank 0."""

    def __init__(self, inner: Linear, group, sizes: list[int], rank: int):
        self.inner, self.group, self.sizes, self.rank = inner, group, sizes, rank
        self.width = max(sizes)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x)
        if x.shape[0] == 0:                       # no row sampled this step: every rank knows (the plan)
            return local.new_zeros((0, sum(self.sizes))) if self.rank == 0 else local
        if local.shape[1] < self.width:
            local = torch.nn.functional.pad(local, (0, self.width - local.shape[1]))
        parts = self.group.gather(local.contiguous(), root=0)
        if self.rank != 0:
            return local
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes)], dim=1)


class TensorParallelModel(LlamaModel):
    """One rank's shard of the model. forward() is the engine's: on rank 0 it runs the step
    protocol (the plan to the workers, the per-rank reports back: driver.Driver.forward) around
    local_forward(), the plain LlamaModel forward over this rank's heads, whose o / down
    projections all-reduce and whose vocabulary head gathers."""

    def __init__(self, mc: ModelConfig, state_dict: dict, plan: ShardPlan, rank: int, group,
                 dtype: torch.dtype = torch.float32, device="cpu", max_positions: int | None = None, switches=None):
        super().__init__(shard_config(mc, plan, rank), shard_state_dict(state_dict, mc, plan, rank), dtype, device,
                         max_positions=max_positions, switches=switches)
        self.full_config, self.plan, self.rank, self.group = mc, plan, rank, group
        for L in self.layers:
            L.o = RowParallelLinear(L.o, group, rank == 0)
            L.down = RowParallelLinear(L.down, group, rank == 0)
        self.lm_head = VocabParallelHead(self.lm_head, group, plan.sizes("vocab_rows"), rank)
        self.driver = None                 # rank 0: the Driver whose protocol wraps every forward
        self.prune_unsampled = False       # same shapes on every rank, whatever taps rank 0 has

    def forward(self, batch, kv, attn) -> torch.Tensor:
        if self.driver is not None:
            return self.driver.forward(batch, kv, attn)
        return self.local_forward(batch, kv, attn)

    def local_forward(self, batch, kv, attn) -> torch.Tensor:
        return LlamaModel.forward(self, batch, kv, attn)
