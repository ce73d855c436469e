"""A CPU double of torch_npu's paged-attention ops: the documented contract, checked, then computed.

Installed as sys.modules["torch_npu"] by install() (tests; or device._import_torch_npu() when
PAGEDKV_NPU_DOUBLE=1 and the real torch_npu does not import: it never shadows a real one),
so the npu backend (attention/npu.py) runs its real code path on a CPU. Each op checks its
arguments where the real op refuses them (RuntimeError naming the argument, what it got and
what the op takes), then computes the documented result in plain torch (float32
accumulation, output in the input dtype).

What it does not check, as the kernels do not: block ids against the cache's num_blocks and
lengths against the pool (that is the probes' job). A read of a block id outside
[0, num_blocks) returns OUT_OF_RANGE_FILL (NaN: freed device memory, as the
page_out_of_range fault's default) instead of raising, as device memory would; a write to a
slot past the pool is dropped (memory this double does not model).

Contracts, and where they were read:
- _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices): ATB
  ReshapeAndCacheOperation (CANN ascendtb docs "ReshapeAndCacheOperation"; op-plugin
  op_plugin/ops/atb/ReshapeAndCachAtb.cpp): key/value [T, N, D] fp16/bf16/int8, caches
  [num_blocks, block_size, N, D] of the same dtype, written in place; slot_indices int32 [T];
  a slot < 0 is skipped (op-plugin test/test_custom_ops/test_atb_reshape_and_cache.py).
  ATB copies non-contiguous inputs (AtbCommon.cpp ParamSetter::Input calls .contiguous()).
  vllm-ascend calls it on 310P (vllm_ascend/device/device_op.py Ascend310PDeviceAdaptor).
- npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, ...,
  cache_mode): op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_pa_kv_cache.md:
  no non-contiguous input; key/value/caches one dtype; slot_mapping int32 or int64;
  cache_mode "Norm" = ND caches [num_blocks, block_size, N, D] (the default "PA_NZ" wants NZ
  caches, not implemented here). vllm-ascend's A2/A3 path (BaseDeviceAdaptor.reshape_and_cache)
  calls it with key.contiguous(), value.contiguous(), cache_mode="Norm".
- _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
  block_table, context_lens, out): ATB PagedAttentionOperation (CANN ascendtb docs
  "PagedAttentionOperation"; op-plugin op_plugin/ops/atb/PagedAttentionAtb.cpp): query
  [B, num_heads, D] fp16/bf16, caches [num_blocks, block_size, num_kv_heads, D],
  block_size % 16 == 0 (128 recommended), 0 < D <= 256, num_heads a multiple of
  num_kv_heads, block_table int32 [B, max_blocks], context_lens int32 [B] (host or device),
  out [B, num_heads, D]. vllm-ascend: attention_v1.py forward_paged_attention.
- npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths,
  actual_seq_lengths_kv, block_table, num_heads, scale, input_layout, num_key_value_heads,
  sparse_mode, block_size, ...) -> (out, softmax_lse): op-plugin
  docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md ("PageAttention
  约束", "TND布局约束") and op_plugin/ops/opapi/FusedInferAttentionScoreKernelNpuOpApi.cpp.
  Implemented: input_layout "TND" with PageAttention, the way vllm-ascend calls it
  (attention_v1.py forward_fused_infer_attention / _get_fia_params): query [T, N, D]
  fp16/bf16, contiguous; key/value = the cache viewed [num_blocks, block_size, Hkv*D]
  (a 4-D key is read as [num_blocks, Hkv, block_size, D]); block_table int32 [B, >= max
  blocks]; actual_seq_lengths cumulative query ends (B entries, <= 4096, non-decreasing,
  last == T); actual_seq_lengths_kv per-sequence context lengths (paged: vllm-ascend passes
  seq_lens_list; cumulative only for the non-paged PrefillNoCache path); sparse_mode 0 with
  no mask, or 3 (rightDownCausal) with the optimised 2048x2048 bool/int8/uint8 mask (vllm-
  ascend: attention_mask.py get_splitfuse_attn_mask, triu(ones(2048, 2048), 1) int8);
  block_size a multiple of 16 <= 1024 (TND, D != 512), N, Hkv <= 256, N / Hkv <= 64,
  D % 16 == 0, Hkv * D <= 65535 for the [num_blocks, block_size, H] layout. The doc's
  "Q_S > 1: block_size a multiple of 128" applies to the BSH/BSND/BNSD layouts; the
  "Q_D = 128 or 192" line of its TND section describes the MLA kernels: vllm-ascend runs
  head_dim 64 models (Qwen2.5-0.5B) through this TND call, so the double does not refuse it.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

__version__ = "double-1"
IS_DOUBLE = True                     # kvwb doctor and device discovery tell the double from the real thing
OUT_OF_RANGE_FILL = float("nan")     # what a block id outside [0, num_blocks) reads: freed device memory

HALF = (torch.float16, torch.bfloat16)
PA_MAX_HEAD = 256                    # ATB PagedAttention: head_size in (0, 256]
FIA_MAX_HEADS, FIA_MAX_GROUP, FIA_MAX_D = 256, 64, 512
FIA_MAX_BLOCK_TND = 1024             # TND, D != 512: block_size a multiple of 16, <= 1024
FIA_MAX_BATCH_TND = 4096             # TND: at most 4096 entries in actual_seq_lengths(_kv)
FIA_MAX_H = 65535                    # [num_blocks, block_size, H] layout: KV_N * D <= 65535
MASK_SHAPES = ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048))


# ---- install as torch_npu -------------------------------------------------------------------
def install():
    """Put this module in sys.modules["torch_npu"] and return it; refused when a real torch_npu imports."""
    from ..npu_module import import_real_torch_npu
    if installed():
        return sys.modules["torch_npu"]
    if import_real_torch_npu() is not None:
        raise RuntimeError("a real torch_npu imports here: the CPU double never shadows it")
    sys.modules["torch_npu"] = sys.modules[__name__]
    return sys.modules[__name__]


def uninstall() -> None:
    if installed():
        del sys.modules["torch_npu"]


def installed() -> bool:
    return sys.modules.get("torch_npu") is sys.modules[__name__]


# ---- argument checks --------------------------------------------------------------------------
def _fail(op: str, arg: str, got: str, want: str):
    raise RuntimeError(f"torch_npu.{op} (CPU double): {arg} {got}; the op requires {want}")


def _desc(t: torch.Tensor) -> str:
    return f"has dtype {t.dtype}, shape {tuple(t.shape)}"


def _tensor(op, arg, t, dtypes=None, dim=None, contiguous=False):
    if not isinstance(t, torch.Tensor):
        _fail(op, arg, f"is {type(t).__name__}", "a Tensor")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(op, arg, _desc(t), f"dtype {' or '.join(str(d) for d in dtypes)}")
    if dim is not None and t.dim() != dim:
        _fail(op, arg, _desc(t), f"a {dim}-D tensor")
    if contiguous and not t.is_contiguous():
        _fail(op, arg, f"{_desc(t)}, strides {t.stride()} (not contiguous)", "a contiguous tensor")
    return t


def _same_dtype(op, arg, t, ref_arg, ref):
    if t.dtype != ref.dtype:
        _fail(op, arg, _desc(t), f"the dtype of {ref_arg} ({ref.dtype})")


def _int(op, arg, x, lo=None, hi=None, multiple=None):
    if isinstance(x, bool) or not isinstance(x, int):
        _fail(op, arg, f"is {x!r} ({type(x).__name__})", "an int")
    if (lo is not None and x < lo) or (hi is not None and x > hi) or (multiple and x % multiple):
        want = " ".join(filter(None, [f">= {lo}" if lo is not None else "", f"<= {hi}" if hi is not None else "",
                                      f"a multiple of {multiple}" if multiple else ""]))
        _fail(op, arg, f"is {x}", want)
    return x


def _lengths(op, arg, x) -> list[int]:
    """A SymInt[] argument: a list / tuple of ints, or a 1-D integer tensor."""
    if x is None:
        _fail(op, arg, "is None", "a list of ints (TND layout and PageAttention need it)")
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            _fail(op, arg, _desc(x), "a 1-D integer tensor or a list of ints")
        return x.tolist()
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        _fail(op, arg, f"is {x!r}", "a list of ints")
    return list(x)


def _cumulative(op, arg, ends: list[int], total: int) -> None:
    """TND actual_seq_lengths: non-negative, non-decreasing, the last one the token count."""
    for i, e in enumerate(ends):
        if e < 0:
            _fail(op, f"{arg}[{i}]", f"is {e}", "non-negative cumulative lengths")
        if i and e < ends[i - 1]:
            _fail(op, f"{arg}[{i}]", f"is {e} < {arg}[{i - 1}]={ends[i - 1]}",
                  "non-decreasing cumulative lengths (each entry ends its sequence: cu_seqlens without the 0)")
    if ends and ends[-1] != total:
        _fail(op, f"{arg}[-1]", f"is {ends[-1]}", f"the token count T={total} of query (TND: the sum of the lengths)")


# ---- emulated device memory and the attention math ----------------------------------------------
def _read_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cache[ids] in float32 ([*ids.shape, *cache.shape[1:]]); an id outside [0, num_blocks) reads
    OUT_OF_RANGE_FILL, as a kernel without a bounds check reads whatever lies past the pool."""
    ids = ids.long()
    bad = (ids < 0) | (ids >= cache.shape[0])
    rows = cache.index_select(0, torch.where(bad, 0, ids).reshape(-1)).float()
    rows = rows.view(*ids.shape, *cache.shape[1:])
    if bool(bad.any()):
        rows[bad] = OUT_OF_RANGE_FILL
    return rows


def _attend(q, k, v, visible, scale, want_lse=False):
    """q [B, Sq, Hq, D], k/v [B, L, Hkv, D] float32 (the keys a kernel reads), visible [B, Sq, L] ->
    (out [B, Sq, Hq, D], lse [B, Sq, Hq] or None). A query with no visible key gets 0 (lse -inf)."""
    b, sq, hq, d = q.shape
    none = ~visible.any(-1)                                  # [B, Sq]: rows a kernel leaves at 0
    if want_lse:
        hkv = k.shape[2]
        s = torch.einsum("bqhgd,blhd->bhgql", q.view(b, sq, hkv, hq // hkv, d), k).mul_(scale)
        s.masked_fill_(~visible[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1).permute(0, 3, 1, 2).reshape(b, sq, hq)
        o = torch.einsum("bhgql,blhd->bqhgd", torch.softmax(s, dim=-1), v).reshape(b, sq, hq, d)
    else:                                                    # the same sum through torch's fused kernel
        lse = None
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=visible[:, None], scale=scale, enable_gqa=True).transpose(1, 2)
    if bool(none.any()):
        o = o.masked_fill(none[:, :, None, None], 0.0)
    return o, lse


def _write_slots(key, value, key_cache, value_cache, slots) -> None:
    nb, bs = key_cache.shape[:2]
    s = slots.long()
    keep = (s >= 0) & (s < nb * bs)      # < 0: padding, skipped; past the pool: memory not modelled here
    if not bool(keep.all()):
        s, key, value = s[keep], key[keep], value[keep]
    key_cache.view(nb * bs, *key_cache.shape[2:]).index_copy_(0, s, key.to(key_cache.dtype))
    value_cache.view(nb * bs, *value_cache.shape[2:]).index_copy_(0, s, value.to(value_cache.dtype))


# ---- the ops --------------------------------------------------------------------------------------
def _check_kv_write(op, key, value, key_cache, value_cache, dtypes, contiguous):
    _tensor(op, "key", key, dtypes, 3, contiguous)
    _tensor(op, "value", value, None, 3, contiguous)
    _same_dtype(op, "value", value, "key", key)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(op, name, c, None, 4, contiguous=True)     # written in place through its raw pointer
        _same_dtype(op, name, c, "key", key)
    if key.shape[:2] != value.shape[:2]:
        _fail(op, "value", _desc(value), f"the [T, N] of key {tuple(key.shape[:2])}")
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:] \
            or key_cache.shape[:2] != value_cache.shape[:2]:
        _fail(op, "key_cache", f"{_desc(key_cache)} (value_cache {tuple(value_cache.shape)})",
              f"[num_blocks, block_size, N, D] matching key {tuple(key.shape)} / value {tuple(value.shape)}")


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    op = "_npu_reshape_and_cache"
    _check_kv_write(op, key, value, key_cache, value_cache, HALF + (torch.int8,), contiguous=False)
    _tensor(op, "slot_indices", slot_indices, (torch.int32,), 1)
    if slot_indices.shape[0] != key.shape[0]:
        _fail(op, "slot_indices", _desc(slot_indices), f"one slot per token of key (T={key.shape[0]})")
    _write_slots(key, value, key_cache, value_cache, slot_indices)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    op = "npu_scatter_pa_kv_cache"
    if cache_mode not in (None, "Norm"):
        _fail(op, "cache_mode", f"is {cache_mode!r} (NZ caches [num_blocks, H*D/16, block_size, 16])",
              "cache_mode='Norm' for ND caches [num_blocks, block_size, N, D] (the only mode this double implements)")
    for name, x in (("compress_lens", compress_lens), ("compress_seq_offsets", compress_seq_offsets),
                    ("seq_lens", seq_lens)):
        if x is not None:
            _fail(op, name, "is given", "None in the 3-D (uncompressed) scenario this double implements")
    _check_kv_write(op, key, value, key_cache, value_cache, HALF + (torch.float32, torch.int8), contiguous=True)
    _tensor(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64), 1, contiguous=True)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(op, "slot_mapping", _desc(slot_mapping), f"one slot per token of key (T={key.shape[0]})")
    _write_slots(key, value, key_cache, value_cache, slot_mapping)


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, *, workspace=None):
    op = "_npu_paged_attention"
    _tensor(op, "query", query, HALF, 3)                    # ATB copies a non-contiguous query
    b, hq, d = query.shape
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(op, name, c, None, 4, contiguous=True)
        _same_dtype(op, name, c, "query", query)
    if key_cache.shape != value_cache.shape:
        _fail(op, "value_cache", _desc(value_cache), f"the shape of key_cache {tuple(key_cache.shape)}")
    nb, bs, hkv, dk = key_cache.shape
    _int(op, "num_heads", num_heads, lo=1)
    if num_heads != hq:
        _fail(op, "num_heads", f"is {num_heads}", f"query's head count {hq} (query {tuple(query.shape)})")
    _int(op, "num_kv_heads", num_kv_heads, lo=0)
    kv_heads = num_kv_heads or num_heads
    if hkv != kv_heads or num_heads % kv_heads:
        _fail(op, "num_kv_heads", f"is {num_kv_heads} (key_cache {tuple(key_cache.shape)})",
              "the head count of key_cache's dim 2, dividing num_heads")
    if dk != d or not 0 < d <= PA_MAX_HEAD:
        _fail(op, "key_cache", _desc(key_cache), f"head_size in (0, {PA_MAX_HEAD}] equal to query's ({d})")
    if bs % 16:
        _fail(op, "key_cache", f"{_desc(key_cache)}: block_size {bs}", "block_size % 16 == 0 (128 recommended)")
    if not isinstance(scale_value, (int, float)) or isinstance(scale_value, bool):
        _fail(op, "scale_value", f"is {scale_value!r}", "a float")
    _tensor(op, "block_table", block_table, (torch.int32,), 2)
    _tensor(op, "context_lens", context_lens, (torch.int32,), 1)
    if block_table.shape[0] != b or context_lens.shape[0] != b:
        _fail(op, "block_table", f"{_desc(block_table)} (context_lens {tuple(context_lens.shape)})",
              f"one row / length per query token (B={b})")
    _tensor(op, "out", out, (query.dtype,), 3, contiguous=True)   # written through its raw pointer
    if out.shape != query.shape:
        _fail(op, "out", _desc(out), f"query's shape {tuple(query.shape)}")

    lens = context_lens.to(query.device).long().clamp(min=0)
    w = max(int(-(-int(lens.max()) // bs)) if b else 0, 1)
    # Table column j of row i is memory at i * width + j: a length past the table's width reads
    # the next row (or unmapped memory past the table), as a kernel that trusts context_lens does.
    flat, width = block_table.reshape(-1).long(), block_table.shape[1]
    cols = torch.arange(w, device=lens.device)
    at = torch.arange(b, device=lens.device)[:, None] * width + cols[None]
    used = cols[None] < -(-lens[:, None] // bs)
    ids = flat[at.clamp(max=flat.numel() - 1)] if flat.numel() else torch.full_like(at, -1)
    ids = torch.where(at < flat.numel(), ids, -1)            # past the table: unmapped memory
    ids = torch.where(used, ids, 0)                          # columns past a row's context are never read
    k = _read_blocks(key_cache, ids).view(b, w * bs, hkv, d)
    v = _read_blocks(value_cache, ids).view(b, w * bs, hkv, d)
    in_ctx = torch.arange(w * bs, device=lens.device)[None] < lens[:, None]
    # Slots past a row's context are padding of this batched emulation, never read by the kernel:
    # zeroed, so NaN / inf left in them cannot reach the sum through 0 * NaN.
    v.masked_fill_(~in_ctx[:, :, None, None], 0.0)
    o, _ = _attend(query.float()[:, None], k, v, in_ctx[:, None], float(scale_value))
    out.copy_(o[:, 0])


_FIA_UNSUPPORTED = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
                    "antiquant_scale", "antiquant_offset", "query_padding_size", "kv_padding_size",
                    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
                    "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope",
                    "key_rope_antiquant_scale")


def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
                                    value_antiquant_mode=0, **optional: Any):
    op = "npu_fused_infer_attention_score"
    for name, x in optional.items():
        if name not in _FIA_UNSUPPORTED:
            raise TypeError(f"npu_fused_infer_attention_score() got an unexpected keyword argument {name!r}")
        if x is not None:
            _fail(op, name, "is given", "None: this double implements the fp16/bf16 TND PageAttention call only")
    if input_layout != "TND":
        _fail(op, "input_layout", f"is {input_layout!r}", "'TND' (the only layout this double implements)")
    _tensor(op, "query", query, HALF, 3, contiguous=True)
    t, n, d = query.shape
    _int(op, "num_heads", num_heads, lo=1, hi=FIA_MAX_HEADS)
    if num_heads != n:
        _fail(op, "num_heads", f"is {num_heads}", f"query's N ({n}, query {tuple(query.shape)}, TND)")
    _int(op, "num_key_value_heads", num_key_value_heads, lo=0, hi=FIA_MAX_HEADS)
    hkv = num_key_value_heads or n
    if n % hkv or n // hkv > FIA_MAX_GROUP:
        _fail(op, "num_key_value_heads", f"is {num_key_value_heads} (num_heads {n})",
              f"a divisor of num_heads with num_heads / num_key_value_heads <= {FIA_MAX_GROUP}")
    if d > FIA_MAX_D or d % 16:
        _fail(op, "query", _desc(query), f"D <= {FIA_MAX_D} and 16-aligned for float16/bfloat16")
    if block_table is None:
        _fail(op, "block_table", "is None", "an int32 [B, max_blocks] table (this double implements PageAttention)")
    _tensor(op, "block_table", block_table, (torch.int32,), 2)
    for name, x in (("key", key), ("value", value)):
        _tensor(op, name, x, None, None, contiguous=True)
        _same_dtype(op, name, x, "query", query)
    if key.shape != value.shape:
        _fail(op, "value", _desc(value), f"the shape of key {tuple(key.shape)}")
    if key.dim() == 3:                                      # [num_blocks, block_size, KV_N * D]
        nb, bs = key.shape[:2]
        if key.shape[2] != hkv * d or hkv * d > FIA_MAX_H:
            _fail(op, "key", _desc(key), f"[num_blocks, block_size, KV_N*D] with KV_N*D = {hkv}*{d} <= {FIA_MAX_H}")
        kk, vv = key.view(nb, bs, hkv, d), value.view(nb, bs, hkv, d)
    elif key.dim() == 4:                                    # [num_blocks, KV_N, block_size, D]
        nb, bs = key.shape[0], key.shape[2]
        if key.shape[1] != hkv or key.shape[3] != d:
            _fail(op, "key", _desc(key), f"a 4-D cache read as [num_blocks, KV_N={hkv}, block_size, D={d}] (view a "
                                         f"[num_blocks, block_size, KV_N, D] cache as [num_blocks, block_size, -1])")
        kk, vv = key.transpose(1, 2), value.transpose(1, 2)
    else:
        _fail(op, "key", _desc(key), "a 3-D [num_blocks, block_size, H] or 4-D [num_blocks, KV_N, block_size, D] cache")
    _int(op, "block_size", block_size, lo=16, hi=FIA_MAX_BLOCK_TND, multiple=16)
    if block_size != bs:
        _fail(op, "block_size", f"is {block_size}", f"the block size of key ({bs}, key {tuple(key.shape)})")
    ends = _lengths(op, "actual_seq_lengths", actual_seq_lengths)
    kv = _lengths(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    bsz = len(ends)
    if not 1 <= bsz <= FIA_MAX_BATCH_TND:
        _fail(op, "actual_seq_lengths", f"has {bsz} entries", f"1 to {FIA_MAX_BATCH_TND} entries (the batch)")
    _cumulative(op, "actual_seq_lengths", ends, t)
    if len(kv) != bsz:
        _fail(op, "actual_seq_lengths_kv", f"has {len(kv)} entries", f"one per sequence of actual_seq_lengths ({bsz})")
    if any(c < 0 for c in kv):
        _fail(op, "actual_seq_lengths_kv", f"is {kv}", "non-negative per-sequence KV lengths")
    need = max(-(-c // bs) for c in kv)
    if block_table.shape[0] != bsz or block_table.shape[1] < need:
        _fail(op, "block_table", _desc(block_table),
              f"[B={bsz}, >= {need}] (B rows, at least the blocks of the longest actual_seq_lengths_kv)")
    if sparse_mode == 3:
        _tensor(op, "atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8), None, contiguous=True)
        if tuple(atten_mask.shape) not in MASK_SHAPES:
            _fail(op, "atten_mask", _desc(atten_mask),
                  "the optimised (2048, 2048) lower-triangular mask for sparse_mode 3")
    elif sparse_mode == 0:
        if atten_mask is not None:
            _fail(op, "atten_mask", "is given with sparse_mode 0", "TND: sparse_mode 0 without a mask, or 3 with one")
    else:
        _fail(op, "sparse_mode", f"is {sparse_mode!r}", "0 (no mask) or 3 (rightDownCausal) in the TND layout")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail(op, "scale", f"is {scale!r}", "a float")

    out = torch.empty_like(query)
    lse = torch.full((t, n, 1), float("-inf")) if softmax_lse_flag else torch.zeros(1)
    start = 0
    for i, (end, c) in enumerate(zip(ends, kv)):            # one sequence at a time, never a token
        q_len = end - start
        if q_len:
            w = -(-c // bs)
            k = _read_blocks(kk, block_table[i, :w]).reshape(1, w * bs, hkv, d)[:, :c]   # the keys the kernel reads
            v = _read_blocks(vv, block_table[i, :w]).reshape(1, w * bs, hkv, d)[:, :c]
            # rightDownCausal (sparse 3): query r of q_len sees keys j <= c - q_len + r
            pos = torch.arange(c)
            visible = (pos[None] <= (c - q_len + torch.arange(q_len))[:, None]) if sparse_mode == 3 \
                else torch.ones(q_len, c, dtype=torch.bool)
            o, l = _attend(query[start:end].float()[None], k, v, visible[None], float(scale), softmax_lse_flag)
            out[start:end] = o[0]
            if softmax_lse_flag:
                lse[start:end, :, 0] = l[0]
        start = end
    return out, lse
