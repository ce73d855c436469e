"""Every kernel path tried once, on a tiny input, against a reference, before anything runs it.

A CPU's flags say what it has, not what a library will do with it: oneDNN has no bf16 inner
product on an AVX2-only CPU ("could not create a primitive descriptor"), a cached build can be
another host's, a compiler can miscompile. So each path the engine may take is run once per
process on a few rows and compared with a plain reference (float64 torch, or the Python loops):

    oneDNN linear (float32 / bfloat16)   plain and prepacked weights, the silu and binary epilogues
    skinny GEMM                          float32 and bf16-stored weights (loader trial, below)
    skinny GEMM at decode sizes          its AVX-512 kernels built (the portable loops are not used)
    skinny GEMM bf16 pairs               gemm_bf (vdpbf16ps)
    compiled attention                   paged decode (float32 and bf16 pages), causal prefill, RMSNorm, absmax
    compiled prefill bf16 dots           paged_prefill's bf16 pairs
    compiled page-pool / sequence loops  against their Python reference (pool_ops.py, seq_ops.py)

A failure is recorded with its reason and the path taken instead (here, or for a native module by
its loader: Kernel.trial()); KernelSelection.refused lists them for engine.kernels and `kvwb doctor`.
Where PAGEDKV_CPU_FEATURES fakes a CPU, a path that needs a feature the faked CPU lacks is refused before it is run (`needs`): so an AVX-512 host behaves as
an AVX2-only one (set ONEDNN_MAX_CPU_ISA=AVX2 too and oneDNN itself refuses, as it does there).
The decisions are made where each path is chosen (linear.py, cpu_bf16.py, skinny_gemm.py, the
kernels loader, pool_ops.py, seq_ops.py); this module only tries and remembers.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu import cpu_features, faked_text


@dataclass(frozen=True)
class Trial:
    path: str            # "oneDNN linear (bfloat16)"
    ok: bool
    why: str = ""        # what failed (empty when confirmed)
    fallback: str = ""   # what runs instead when refused

    def line(self) -> str:
        return f"{self.path}: confirmed" if self.ok else f"{self.path}: {self.why}; instead: {self.fallback}"


_done: dict[str, Trial] = {}
_lock = threading.RLock()


class Mismatch(RuntimeError):
    """A path ran but its result is not the reference's."""


class Unfit(RuntimeError):
    """A path that runs right but is not worth running on this CPU (its reason says why)."""


def attempt(path: str, fallback: str, fn, needs: tuple[str, ...] = ()) -> Trial:
    """Try `fn()` once per process (it raises on failure); `needs`: features of which the CPU must
    have one, checked where PAGEDKV_CPU_FEATURES fakes the CPU (a real CPU is judged by the run)."""
    got = _done.get(path)
    if got is not None:
        return got
    with _lock:
        if path not in _done:
            _done[path] = run(path, fallback, fn, needs)
    return _done[path]


def run(path: str, fallback: str, fn, needs: tuple[str, ...] = ()) -> Trial:
    """Try `fn()` now, remembering nothing (the loader keeps each module's own result)."""
    fake = faked_text()
    if fake is not None and needs and not set(needs) & cpu_features():
        return Trial(path, False, f"the CPU faked by PAGEDKV_CPU_FEATURES={fake!r} has none of "
                                  f"{', '.join(needs)}", fallback)
    try:
        fn()
    except Exception as e:            # a missing primitive, a wrong result, an unbuilt kernel
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if isinstance(e, Unfit):
            return Trial(path, False, msg[:300], fallback)
        kind = "gave a wrong result" if isinstance(e, Mismatch) else f"raised {type(e).__name__}"
        return Trial(path, False, f"{kind} on a tiny input: {msg[:300]}", fallback)
    return Trial(path, True)


def done() -> list[Trial]:
    """The paths tried so far beside the loader's modules (oneDNN, the bf16 sub-kernels), in order."""
    return list(_done.values())


def forget() -> None:
    """Tests: try again (a new fake CPU, a patched path)."""
    with _lock:
        _done.clear()


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.double().abs().max().item())
    if not (got.shape == want.shape and err <= tol * scale):     # NaN fails this too
        raise Mismatch(f"{what}: max |error| {err:.3g} (shape {tuple(got.shape)}), allowed {tol * scale:.3g}")


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


# ---- oneDNN's linears -------------------------------------------------------------------------------
ONEDNN_FP32_NEEDS = ("sse4_1", "sse4_2", "avx", "avx2", "avx512f", "asimd")    # oneDNN's x64 floor is SSE4.1
ONEDNN_BF16_NEEDS = ("avx512bw", "avx512_bf16", "amx_bf16", "avx_ne_convert")  # its bf16 ip, by the reorder's message


def _case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b, F.linear(x.double(), w.double(), b.double())


def _onednn(dtype: torch.dtype) -> None:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise RuntimeError("this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    x, w, b, ref = _case(5, 32, 24, dtype)
    lp, tol = torch.ops.mkldnn._linear_pointwise, _tol(dtype)
    close(lp(x, w, b, "none", [], ""), ref, tol, "plain weight")
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    close(lp(x, packed, b, "swish", [], ""), F.silu(ref), tol, "prepacked weight, silu epilogue")
    other = torch.randn(5, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    close(lp.binary(x, other, packed, b, "mul"), ref * other.double(), tol, "prepacked weight, mul epilogue")
    close(lp.binary(x, other, w, b, "add"), ref + other.double(), tol, "plain weight, add epilogue")


def onednn_linear(dtype: torch.dtype) -> Trial:
    """oneDNN's CPU linear in `dtype` (float32 or bfloat16), tried once."""
    name = str(dtype).removeprefix("torch.")
    needs = ONEDNN_BF16_NEEDS if dtype == torch.bfloat16 else ONEDNN_FP32_NEEDS
    fallback = ("torch's F.linear in bfloat16" if dtype == torch.bfloat16 else "torch's F.linear")
    return attempt(f"oneDNN linear ({name})", fallback, lambda: _onednn(dtype), needs)


# ---- the skinny GEMM (a loader trial: a failure keeps the module from loading) ---------------------
def skinny_gemm(mod) -> None:
    for dtype in (torch.float32, torch.bfloat16):            # float32, and bf16 weights widened (storage)
        x, w, b, ref = _case(3, 40, 33, dtype)
        got = mod.gemm(x.float(), mod.pack(w.contiguous()), 33, b.float(), 1, None, 0)
        close(got, F.silu(ref), 1e-4, f"gemm (silu epilogue), {dtype} weights")


def _vectorised(mod) -> None:
    if not mod.vectorised():
        raise Unfit("the build has only the portable loops (compiled for a CPU without AVX-512): on "
                    "SmolLM2's decode they ran 7-25x slower than oneDNN (the GGUF's blocks re-widened "
                    "every call)")


def skinny_vectorised(mod) -> Trial:
    """The skinny GEMM at decode sizes: only with its AVX-512 kernels. Its portable loops are right
    (the loader's trial) but far slower than oneDNN, so the linears do not route to them."""
    return attempt("skinny GEMM at decode sizes", "oneDNN / F.linear at every size (a GGUF's blocks widened "
                   "to float32 at load)", lambda: _vectorised(mod))


def _pairs(mod) -> None:
    if not mod.bf16_dot():
        raise RuntimeError("the build has no avx512_bf16 kernel (compiled on a CPU without it)")
    x, w, b, ref = _case(3, 40, 33, torch.bfloat16)
    close(mod.gemm_bf(x, mod.pack_pairs(w.contiguous()), 33, b.float(), 0, None, 0), ref, 3e-2, "gemm_bf")


def bf16_pairs(mod) -> Trial:
    return attempt("skinny GEMM bf16 pairs", "the float32 skinny GEMM over the bf16 weights (up to 4 rows), "
                   "oneDNN / F.linear above", lambda: _pairs(mod), ("avx512_bf16",))


# ---- the compiled attention ------------------------------------------------------------------------
def dense_attention(q, k, v, causal_from=None) -> torch.Tensor:
    """q [n, H, D], k / v [c, Hk, D]: float64 softmax attention; query j sees keys <= causal_from + j."""
    h, hk = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(h // hk, dim=1)
    v = v.double().repeat_interleave(h // hk, dim=1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) / math.sqrt(q.shape[-1])
    if causal_from is not None:
        allowed = torch.arange(k.shape[0])[None, :] <= causal_from + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v)


def _decode(mod, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    ps, h, hk, d, lens = 16, 4, 2, 64, [5, 21]
    kc, vc = (torch.randn(4, ps, hk, d, generator=g).to(cache_dtype) for _ in range(2))
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    q = torch.randn(2, h, d, generator=g)
    out = torch.zeros_like(q)
    mod.paged_decode(q, out, kc, vc, tables, torch.tensor([0, 1]), torch.tensor([0, 1]),
                     torch.tensor(lens, dtype=torch.int32), 1 / math.sqrt(d))
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // ps)].long()
        k = kc[pages].reshape(-1, hk, d)[:n]
        v = vc[pages].reshape(-1, hk, d)[:n]
        close(out[i:i + 1], dense_attention(q[i:i + 1], k, v), 1e-4, f"paged_decode, {cache_dtype} pages, row {i}")


def _prefill(mod, dtype: torch.dtype, bf16_dots: bool) -> None:
    g = torch.Generator().manual_seed(4)
    n, h, hk, d = 19, 4, 2, 64
    q, k, v = (torch.randn(n, x, d, generator=g).to(dtype) for x in (h, hk, hk))
    cache = torch.zeros(2, 16, hk, d, dtype=dtype)
    out = torch.zeros_like(q)
    chunks = torch.tensor([[0, n, n, 0, 1, 0]], dtype=torch.int64)     # one fresh chunk, no cached context
    mod.paged_prefill(q, out, k, v, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int32), chunks,
                      1 / math.sqrt(d), bf16_dots)
    close(out, dense_attention(q, k, v, causal_from=0), 1e-4 if dtype == torch.float32 else 3e-2,
          f"paged_prefill ({dtype}{', bf16 dots' if bf16_dots else ''})")


def _helpers(mod) -> None:
    """The module's small helpers the model calls every layer: RMSNorm, the NaN-propagating absmax."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 72, generator=g), torch.randn(72, generator=g)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    close(mod.rms_norm(x, w, 1e-5), want, 1e-5, "rms_norm")
    # with a buffer: the same rows out, and each input row's max |x| into the named row of the buffer only
    # (the next layer's norm measures the hidden state the fp16 probe reads); bf16 rows measured exactly
    hid = torch.full((3, 5), -1.0)
    close(mod.rms_norm(x, w, 1e-5, hid, 1), want, 1e-5, "rms_norm with a measurement buffer")
    close(hid[1], x.abs().amax(1), 0, "rms_norm's row absmax")
    close(hid[[0, 2]], torch.full((2, 5), -1.0), 0, "rms_norm's other rows of the measurement buffer")
    xb = x.bfloat16()
    mod.rms_norm(xb, w, 1e-5, hid, 2)
    close(hid[2], xb.float().abs().amax(1), 0, "rms_norm's row absmax of bf16 rows")
    close(mod.row_absmax(x), x.abs().amax(1), 0, "row_absmax")
    kv = torch.randn(5, 3, 40, generator=g)            # K and V as views of one q|k|v buffer: strided rows
    close(mod.rows_absmax([kv[:, 1], kv[:, 2, :24]]), torch.stack([kv[:, 1].abs().amax(1), kv[:, 2, :24].abs().amax(1)]),
          0, "rows_absmax")
    # rope_write's measurement of each row's max |k|, |v| and largest head norm of k and q (what
    # KVWritten and the fp16 probe read); cos 1, sin 0: the rotation is the identity, so the rows'
    # own figures are the answer
    hq, hkv, d = 2, 1, 8
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
    k, v = qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    want = torch.stack([k.abs().amax(1), v.abs().amax(1), k.reshape(3, hkv, d).norm(dim=-1).amax(1),
                        qkv[:, :hq * d].reshape(3, hq, d).norm(dim=-1).amax(1)])
    out = torch.empty(4, 3)
    mod.rope_write(qkv, torch.ones(3, d), torch.zeros(3, d), torch.zeros(2, 4, hkv, d), torch.zeros(2, 4, hkv, d),
                   torch.tensor([0, 5, 2]), hq, hkv, out)
    close(out, want, 1e-5, "rope_write's row figures")
    whole = torch.full((3, 4, 3), -1.0)                 # a forward's [L, S, T] buffer: layer 1's slice only
    mod.rope_write(qkv, torch.ones(3, d), torch.zeros(3, d), torch.zeros(2, 4, hkv, d), torch.zeros(2, 4, hkv, d),
                   torch.tensor([0, 5, 2]), hq, hkv, whole, 1)
    close(whole[1], want, 1e-5, "rope_write's row figures into a layer of the forward's buffer")
    close(whole[[0, 2]], torch.full((2, 4, 3), -1.0), 0, "rope_write's other layers of the forward's buffer")
    x[2, 7] = float("nan")
    if not math.isnan(mod.absmax(x)):
        raise Mismatch("absmax: a NaN in the input did not propagate")
    mod.rms_norm(x, w, 1e-5, hid, 0)
    if not (math.isnan(float(hid[0, 2])) and not math.isnan(float(hid[0, 1]))):
        raise Mismatch("rms_norm: a NaN in a row did not propagate to (only) its absmax")
    if not math.isnan(float(mod.rows_absmax([x, x])[1, 2])):
        raise Mismatch("rows_absmax: a NaN in the input did not propagate to its row")


def attention(mod) -> None:
    _decode(mod, torch.float32)
    _decode(mod, torch.bfloat16)
    _prefill(mod, torch.float32, False)
    _helpers(mod)


def _prefill_dots(mod) -> None:
    if not getattr(mod, "prefill_bf16_dot", lambda: False)():
        raise RuntimeError("the build has no avx512_bf16 prefill dots (compiled on a CPU without it)")
    _prefill(mod, torch.bfloat16, True)


def prefill_bf16_dots(mod) -> Trial:
    return attempt("compiled prefill bf16 dots", "float32 attention between the bf16 GEMMs",
                   lambda: _prefill_dots(mod), ("avx512_bf16",))
