"""A Llama-family decoder (llama; qwen2 = llama + qkv bias) over packed tokens and paged KV.

q|k|v is one GEMM: on a 2-core CPU the step time is the matmul time, and fewer, larger
GEMMs run closer to peak. The elementwise work rides in the GEMMs' epilogues instead
(silu on gate, * silu(gate) on up, the residual adds on o and down): each saved pass
over the activations is ~0.1-1 ms per layer at prefill sizes.
"""
from __future__ import annotations

from time import perf_counter_ns

import torch
import torch.nn.functional as F

from . import cpu_bf16
from .attention import native
from .attention.base import AttentionBackend
from .batch import PackedBatch
from .kv_cache import KVCache
from .linear import Linear
from .model_config import ModelConfig
from .quant_layout import QuantBlocks


def norm_measures(x: torch.Tensor) -> bool:
    """Whether rms_norm(x, ...) runs the compiled kernel, which can also measure each row's max |x|."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.dim() == 2
            and native.kernel() is not None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, absmax: torch.Tensor | None = None,
             row: int = 0) -> torch.Tensor:
    """absmax: a float32 [N, rows] buffer whose row `row` gets each row's max |x| (only where
    norm_measures(x): the caller asks first)."""
    if norm_measures(x):
        # one pass, no OpenMP fork at decode sizes; native bf16 rows are widened, normed in float32
        # and rounded once, in the same pass (torch's bf16 formula below makes 6 passes, ~10x the
        # time at prefill sizes, and rounds twice). A bf16 weight is widened in the kernel.
        return native.kernel().rms_norm(x if x.stride(-1) == 1 else x.contiguous(), w, eps, absmax, row)
    if x.dtype == torch.float32:                       # torch's kernel
        return F.rms_norm(x, w.shape, w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D] (rotate-half convention, as Hugging Face Llama)."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


class Layer:
    # Fault seams: the projections `qkv` and `o`, replaced by Linears of the same shape (rescaled
    # weights: fp16_kv_overflow).
    FAULT_SEAMS = frozenset({"qkv", "o"})

    def __init__(self, sd: dict, i: int, cfg: ModelConfig, dtype, device, compute_dtype=None, quantized=None,
                 switches=None):
        """Projection weights in `dtype`, computed (and norms held) in `compute_dtype`;
        `quantized`: the file's blocks by name (weights.LoadedModel.quantized), used where exact;
        `switches`: the EngineConfig whose linear_backend and quant_layout the linears follow."""
        p = f"model.layers.{i}."
        cd = compute_dtype or dtype
        g = lambda n: sd[p + n].to(device=device, dtype=dtype)
        qb = lambda *names: QuantBlocks.cat([(quantized or {}).get(p + n) for n in names])
        lin = lambda w, b=None, q=None: Linear(w.contiguous(), b, compute_dtype=cd, quant=q, **_linear_kw(switches))
        qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        self.qkv = lin(torch.cat([g(n) for n in qkv]),
                       torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"),
                                  g("self_attn.v_proj.bias")]) if cfg.attention_bias else None, qb(*qkv))
        self.o = lin(g("self_attn.o_proj.weight"), q=qb("self_attn.o_proj.weight"))
        self.gate = lin(g("mlp.gate_proj.weight"), q=qb("mlp.gate_proj.weight"))
        self.up = lin(g("mlp.up_proj.weight"), q=qb("mlp.up_proj.weight"))
        self.down = lin(g("mlp.down_proj.weight"), q=qb("mlp.down_proj.weight"))
        self.norm_attn = g("input_layernorm.weight").to(cd)
        self.norm_mlp = g("post_attention_layernorm.weight").to(cd)


def _linear_kw(switches) -> dict:
    """Linear's backend / layout from an EngineConfig; none given: Linear asks the environment."""
    return {} if switches is None else {"backend": switches.linear_backend, "layout": switches.quant_layout}


class LlamaModel:
    # Fault seams: `forward` (wrapped: the block-table bind drifted after the launch, stale_binding).
    FAULT_SEAMS = frozenset({"forward"})

    def __init__(self, cfg: ModelConfig, state_dict: dict, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None,
                 compute_dtype: torch.dtype | None = None, quantized: dict | None = None, switches=None):
        self.device = torch.device(device)
        # weight_dtype: how the weights are stored; dtype: what activations are computed in.
        # They differ for bfloat16 on a CPU without native bf16 GEMMs (cpu_bf16.py, "storage").
        # switches: the EngineConfig (bf16_mode, linear_backend, quant_layout); None: the environment's.
        self.cfg, self.weight_dtype = cfg, dtype
        bf16 = None if switches is None else switches.bf16_mode
        self.dtype = cd = compute_dtype or cpu_bf16.compute_dtype(dtype, self.device, bf16)
        d = self.device
        self.embed = state_dict["model.embed_tokens.weight"].to(device=d, dtype=dtype)
        head = state_dict.get("lm_head.weight")
        tied = head is None or cfg.tie_word_embeddings
        q = (quantized or {}).get("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.lm_head = Linear(self.embed if tied else head.to(d, dtype).contiguous(), compute_dtype=cd, quant=q,
                              **_linear_kw(switches))
        self.tied = tied
        self.norm = state_dict["model.norm.weight"].to(device=d, dtype=cd)
        self.layers = [Layer(state_dict, i, cfg, dtype, d, cd, quantized, switches) for i in range(cfg.num_layers)]
        cos, sin = rope_tables(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta)
        self.cos, self.sin = cos.to(d, cd), sin.to(d, cd)
        # float32 tables for the compiled RoPE (it rotates in float32, bf16 rows too) and for native
        # bf16's float32 attention (attention_dtype).
        self.cos32, self.sin32 = (cos.to(d), sin.to(d)) if cd != torch.float32 else (self.cos, self.sin)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.hooks = None     # set by the engine while probes listen: on_kv / on_attention / on_hidden
        self.prune_unsampled = True   # last layer's o_proj + MLP for sampled rows only (see forward)

    @property
    def num_params(self) -> int:
        n = self.embed.numel() + self.norm.numel() + (0 if self.tied else self.lm_head.numel)
        for L in self.layers:
            n += sum(m.numel for m in (L.qkv, L.o, L.gate, L.up, L.down)) + L.norm_attn.numel() + L.norm_mlp.numel()
        return n

    @property
    def layer_bytes(self) -> int:
        """Weight bytes one forward streams through the decoder layers (excluding the vocab head)."""
        return sum(m.nbytes for L in self.layers for m in (L.qkv, L.o, L.gate, L.up, L.down))

    @property
    def linear_backend(self) -> str:
        return self.layers[0].qkv.backend if self.layers else self.lm_head.backend

    def attention_dtype(self, attn: AttentionBackend, cache: torch.Tensor | None) -> torch.dtype:
        """What q, k, v and attention's output are computed in. Native bf16 on a CPU: bf16 where the
        backend's compiled kernels take bf16 rows (RoPE + K/V store in one pass, prefill with bf16
        dots, decode widening its few rows: a CPU and a build with avx512_bf16), else float32 between
        the bf16 GEMMs, where the compiled kernels take float32 rows (the widening is exact; bf16 there
        would take torch's unfused RoPE, an index_copy per layer and one SDPA call per sequence, ~2x
        the step's attention time). bf16 rows skip a widening of q|k|v and a narrowing of the output
        per layer (~3% of a prefill-heavy run)."""
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and cache is not None:
            if attn.fused_rope_write(torch.bfloat16, cache):
                return torch.bfloat16
            if attn.fused_rope_write(torch.float32, cache):
                return torch.float32
        return self.dtype

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv: KVCache, attn: AttentionBackend) -> torch.Tensor:
        """Run every packed token; returns logits [S, vocab] for the rows in batch.logits_indices."""
        cfg = self.cfg
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = batch.input_ids.shape[0]
        h = F.embedding(batch.input_ids, self.embed).to(self.dtype)
        adt = self.attention_dtype(attn, kv.k[0] if kv.k else None)
        widen = adt != self.dtype                     # native bf16 without bf16 attention kernels: float32
        # RoPE and the K/V store in one pass where the backend has it (the compiled CPU kernel
        # on a plain float32 or bf16 cache; it takes float32 cos / sin); the torch formulas and
        # write_kv everywhere else.
        fused = attn.fused_rope_write(adt, kv.k[0]) if kv.k else False
        cos, sin = (self.cos32, self.sin32) if widen or fused else (self.cos, self.sin)
        cos = cos.index_select(0, batch.positions)
        sin = sin.index_select(0, batch.positions)
        # The step's attention plan, once for every layer; kept on the batch for observers.
        plan = batch.attn_plan = attn.plan(batch, adt, kv.k[0])
        if not fused:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        hooks = self.hooks
        # The last layer's o_proj and MLP run only for the rows that are sampled: the other rows'
        # K/V are stored by then, and nothing else reads their final hidden state (a prefill
        # chunk of 2048 tokens samples a handful). Not while a tap reads every row's hidden state
        # (asked at the last layer: the fp16 probe reads it on the steps it measures), nor under
        # tensor parallel (prune_unsampled), where every rank must run the same shapes whatever
        # taps rank 0 has.
        rows = batch.logits_indices
        may_prune, pruned = self.prune_unsampled and rows.shape[0] < t, False
        last = len(self.layers) - 1
        kvmax = quiet = hmax = None
        if hooks is not None:
            hooks.begin_forward(batch)               # taps that read a few layers say which, once
            if fused and adt == torch.float32:       # the store measures each row's max |K|, |V| as it goes
                kvmax = hooks.kv_absmax_buffer(t, len(self.layers))
            if norm_measures(h):                     # each layer's norm measures the hidden state it reads
                hmax = hooks.hidden_absmax_buffer(t, len(self.layers))
            quiet, kv_t, read_t = hooks.quiet, hooks.kv_t, hooks.read_t   # layers where only a time is taken
        try:
            for i, L in enumerate(self.layers):
                # from layer 1 on, the norm measures layer i - 1's hidden state as it reads it
                x = rms_norm(h, L.norm_attn, cfg.rms_norm_eps, hmax if i else None, i - 1)
                qkv = L.qkv(x)
                if widen:
                    qkv = qkv.float()
                if fused and qkv.is_contiguous():         # rotate in place, store k, v at their slots
                    if kvmax is not None:                # the store fills layer i's slice of the [L, S, T] buffer
                        batch.kv_absmax, batch.kv_layer = kvmax, i
                    measured = attn.rope_write(qkv, cos, sin, kv.k[i], kv.v[i], batch) is True and kvmax is not None
                    q = qkv[:, : self.q_size].view(t, hq, hd)
                    k = qkv[:, self.q_size: self.q_size + self.kv_size].view(t, hkv, hd)
                    v = qkv[:, self.q_size + self.kv_size:].view(t, hkv, hd)
                    if hooks is not None:                # the values a probe sees are the ones stored
                        if measured and quiet[i]:
                            kv_t[i] = perf_counter_ns()
                        else:
                            hooks.on_kv(i, k, v, batch, q=q, measured=measured)
                else:
                    if fused:                            # a non-contiguous qkv (bias layouts): unfused this layer
                        cos, sin = cos.to(adt).unsqueeze(1), sin.to(adt).unsqueeze(1)
                        fused = False
                    qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, hd), cos, sin)
                    q, k = qk[:, :hq], qk[:, hq:]        # rotated together: one pass, not two
                    v = qkv[:, self.q_size + self.kv_size:].view(t, hkv, hd)
                    if hooks is not None:
                        hooks.on_kv(i, k, v, batch, q=q)
                    attn.write_kv(k, v, kv.k[i], kv.v[i], batch, plan)
                o = attn.forward(q, k, v, kv.k[i], kv.v[i], batch, plan)
                if hooks is not None:
                    if quiet[i]:
                        read_t[i] = perf_counter_ns()
                    else:
                        hooks.on_attention(i, batch, batch.block_tables, o)
                o = o.reshape(t, hq * hd)
                if widen:
                    o = o.to(self.dtype)
                if may_prune and i == last and (hooks is None or not hooks.reads_hidden):
                    o, h = o.index_select(0, rows), h.index_select(0, rows)
                    pruned = True
                h = L.o.add(o, h)                                     # h + o_proj(o)
                x = rms_norm(h, L.norm_mlp, cfg.rms_norm_eps)
                h = L.down.add(L.up.mul(x, L.gate.silu(x)), h)         # h + down(silu(gate x) * up x)
                if hooks is not None and hooks.hidden_calls[i]:     # a tap reads this layer's hidden state
                    hooks.on_hidden(i, h, batch)
        except BaseException:
            batch.kv_absmax = None
            if hooks is not None:               # what the layers that ran measured, for the failed step's record
                hooks.forward_failed(batch)
            raise
        batch.kv_absmax = None
        if hooks is not None:
            hooks.end_forward(batch)
        if not pruned:
            h = h.index_select(0, rows)
        return self.lm_head(rms_norm(h, self.norm, cfg.rms_norm_eps)).float()
