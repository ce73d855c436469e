"""Linear layers for the hot path: a skinny GEMM for decode-sized inputs, oneDNN above.

Measured here (2 cores, 30 layers of SmolLM2's shapes, weights from DRAM):
- decode sizes (1-48 rows): the compiled skinny GEMM (csrc/skinny_gemm.cpp) streams the
  weights once per call; at 24 rows it runs the decoder's linears in 34 ms where oneDNN's
  prepacked kernel takes 40 and MKL's sgemm (F.linear) 82; at 1 row 22 vs 26 ms;
- prefill sizes (>= 64 rows): oneDNN's prepacked kernel (the op torch's inductor uses for
  CPU linears), ~300 GFLOP/s, with the epilogue (silu, * other, + residual) fused.
In float32 both layouts are kept (2x the weights' memory: the speed is the point here),
except where a GGUF's blocks replace the skinny one (below).
bfloat16 weights on a CPU without native bf16 GEMMs (engine/cpu_bf16.py, "storage") are
kept once, in the skinny layout: decode sizes read them as bf16, larger inputs widen them
to float32 for oneDNN once per call (~1% of that GEMM's time).
A GGUF's own Q4_1 / Q8_0 blocks (engine/quant_layout.py) replace the float32 skinny layout
when they widen to the float32 weight bit for bit (checked at load): decode sizes then stream
~3.6x fewer bytes for the same float32 products.
Each layout is checked against F.linear once at load and dropped if it disagrees; before that,
each path (oneDNN in each dtype, the skinny GEMM, its bf16 pair kernel) passed its process-wide
trial (kernels/trials.py), so a CPU without a feature gets F.linear, never a crash mid-step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import env, quant_layout, skinny_gemm
from .kernels import trials

_PACK_HINT = 16          # batch-size hint for the weight layout; measured insensitive from 1 to 2048
# Rows up to which the skinny GEMM beats oneDNN, measured by benchmarks/linear_speed.py:
# fp32 weights stream 4 bytes a weight (oneDNN is level at 64 rows), bf16 ones 2.
SKINNY_MAX_ROWS = {torch.float32: 48, torch.bfloat16: 128}
# The file's quantized blocks stream ~3.5x fewer bytes than float32: ahead of oneDNN up to
# ~64-96 rows by benchmarks/linear_speed.py (1.6x at 24, 1.2x at 64, 0.84-1.05x at 96).
QUANT_MAX_ROWS = 64
# Native bf16 (bf16 activations; oneDNN's bf16 kernel above these rows), by benchmarks/linear_speed.py's
# native bf16 section: the skinny GEMM's bf16 pair kernel (vdpbf16ps, csrc/skinny_gemm.cpp gemm_bf)
# up to NATIVE_BF16_SKINNY_ROWS; where it is not compiled in (no avx512_bf16: PAGEDKV_BF16=native
# forced), the float32 skinny GEMM over the same bf16 weights, which wins only where the weight
# stream is the cost (1.9x at 1 row, 1.35x at 4, level at 8). The pair kernel: 1.1-1.8x at 1-96 rows.
NATIVE_BF16_SKINNY_ROWS = 64
NATIVE_BF16_WIDENING_ROWS = 4
_ONEDNN_ACT = {"none": "none", "silu": "swish"}     # oneDNN's names for the unary epilogues


def _onednn_usable(w: torch.Tensor, backend: str) -> bool:
    """Whether oneDNN may serve weights of w's dtype: not switched off, and its linear in that dtype
    passed its trial on this CPU (kernels/trials.py: an AVX2-only CPU has no bf16 inner product)."""
    if backend == "torch":                         # linear_backend / PAGEDKV_LINEAR=torch: F.linear, no oneDNN either
        return False
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and trials.onednn_linear(w.dtype).ok)


def _agrees(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol))


class Linear:
    """y = x @ W.T + b, with W [out, in]; computed in `compute_dtype` (default W's dtype).
    `backend` / `layout`: EngineConfig.linear_backend / quant_layout (None: the environment's
    override, else auto)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None, quant: quant_layout.QuantBlocks | None = None,
                 backend: str | None = None, layout: str | None = None):
        backend = env.value("PAGEDKV_LINEAR") if backend is None else backend
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.compute_dtype = compute_dtype or weight.dtype
        if self.compute_dtype not in (self.dtype, torch.float32):
            raise ValueError(f"Linear: {self.dtype} weights compute in their dtype or float32, "
                             f"not {self.compute_dtype}")
        self.bias = None if bias is None else bias.to(self.compute_dtype)
        self._bias32 = None if bias is None else self.bias.float()   # what the skinny GEMM takes
        self.packed = None       # oneDNN's prepacked layout (weights in the compute dtype)
        self.skinny = None       # the skinny GEMM's layout [ceil(out/16), in, 16] (float32 compute)
        self.quant = None        # or the file's blocks in it: (Wq uint8, format), quant_layout.py
        self.weight = weight
        self.skinny_rows = SKINNY_MAX_ROWS.get(self.dtype, 0)
        widened = self.compute_dtype != self.dtype           # bf16 storage, fp32 compute
        x = torch.randn(3, self.in_features, dtype=self.compute_dtype, device=self.device)
        ref = F.linear(x, weight.to(self.compute_dtype), self.bias)
        native_bf16 = self.device.type == "cpu" and self.compute_dtype == self.dtype == torch.bfloat16
        # not a build of the portable loops only (an AVX2 CPU): oneDNN is faster than those
        k = (skinny_gemm.for_linears() if self.device.type == "cpu" and backend != "torch"
             and (self.compute_dtype == torch.float32 or native_bf16) else None)
        self.pairs = False       # native bf16: the skinny layout is gemm_bf's bf16 pairs [nb, in/2, 16, 2]
        if native_bf16:
            self.pairs = k is not None and skinny_gemm.bf16_pairs() and self.in_features % 2 == 0
            self.skinny_rows = NATIVE_BF16_SKINNY_ROWS if self.pairs else NATIVE_BF16_WIDENING_ROWS
        if k is not None and quant is not None and quant_layout.enabled(layout) and self.dtype == torch.float32:
            self.quant = self._exact_quant(k, weight, quant)
            if self.quant is not None and not _agrees(self._skinny(x, 0, None, 0), ref, torch.float32):
                self.quant = None
            if self.quant is not None:
                self.skinny_rows = QUANT_MAX_ROWS
        if k is not None and self.quant is None:
            try:
                packed = (k.pack_pairs if self.pairs else k.pack)(weight.contiguous())
                self.skinny = packed
                if not _agrees(self._skinny(x, 0, None, 0), ref, self.compute_dtype):
                    self.skinny = None
            except RuntimeError:
                self.skinny = None                              # oneDNN / F.linear at every size
        if not widened and _onednn_usable(weight, backend):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
                got = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
                if _agrees(got, ref, self.dtype):
                    self.packed = packed
            except RuntimeError:
                pass
        if self.packed is not None or (widened and self.skinny is not None):
            self.weight = None                                 # the other layouts hold it
        # A plain (unpacked, compute-dtype) weight for oneDNN: decided once, not per call.
        self._onednn_plain = _onednn_usable(torch.empty(0, dtype=self.compute_dtype, device=self.device), backend)

    def _exact_quant(self, k, weight: torch.Tensor, quant: quant_layout.QuantBlocks):
        """(Wq, format) when the blocks widen to `weight` bit for bit, else None (kept dense):
        the check is against the loader's own float32 weights, so blocks from another file, a
        patched weight or a packing bug cannot change what the model computes."""
        if quant.shape != tuple(weight.shape):
            return None
        wq, fmt = quant_layout.pack(quant)
        try:
            widened = k.unpack_q(wq, self.in_features, self.out_features, fmt)
        except RuntimeError:
            return None
        same = torch.equal(widened.view(torch.int32), weight.contiguous().view(torch.int32))
        return (wq, fmt) if same else None

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())

    @property
    def nbytes(self) -> int:
        """Weight bytes one call streams (the stored dtype's)."""
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def backend(self) -> str:
        if self.quant is not None:
            fmt = {v: n for n, v in quant_layout.FORMATS.items()}[self.quant[1]]
            return f"skinny[{fmt}]+" + ("onednn" if self.packed is not None else "torch")
        if self.skinny is not None and self.pairs:
            return "skinny[bf16 pairs]+" + ("onednn" if self.packed is not None else "torch")
        if self.skinny is not None:
            return "skinny+onednn" if self.packed is not None or self.weight is None else "skinny+torch"
        return "onednn" if self.packed is not None else "torch"

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight in its stored dtype, whichever layouts hold it."""
        if self.weight is not None:
            return self.weight
        if self.skinny is not None and self.pairs:
            return self.skinny.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features].contiguous()
        if self.skinny is not None:
            return skinny_gemm.kernel().unpack_float(self.skinny, self.out_features).to(self.dtype)
        if self.quant is not None:
            return skinny_gemm.kernel().unpack_q(self.quant[0], self.in_features, self.out_features, self.quant[1])
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.device)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").T.contiguous()

    # ---- the three ways to run it -------------------------------------------------------
    def _skinny(self, x: torch.Tensor, act: int, other: torch.Tensor | None, op: int) -> torch.Tensor:
        bias = self._bias32
        if self.pairs:                                           # native bf16: bf16 in and out, fp32 sums
            bf16 = torch.bfloat16                                # (a dtype test, not a no-op .to(): ~5 us a call)
            x = x if x.dtype == bf16 else x.to(bf16)
            if x.stride(-1) != 1 or x.stride(0) % 2:
                x = x.contiguous()
            if other is not None:
                other = other if other.dtype == bf16 else other.to(bf16)
                other = other if other.stride(-1) == 1 else other.contiguous()
            return skinny_gemm.kernel().gemm_bf(x, self.skinny, self.out_features, bias, act, other, op)
        # float32 in and out; native bf16 without the pair kernel widens its activations (exact)
        # and rounds the result once
        x = x.float() if x.dtype != torch.float32 else x        # a caller's narrower copy (probes)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if other is not None:
            other = other.float() if other.dtype != torch.float32 else other
            other = other if other.stride(-1) == 1 else other.contiguous()
        if self.quant is not None:
            return skinny_gemm.kernel().gemm_q(x, self.quant[0], self.out_features, self.quant[1], bias,
                                               act, other, op)
        y = skinny_gemm.kernel().gemm(x, self.skinny, self.out_features, bias, act, other, op)
        return y if self.compute_dtype == torch.float32 else y.to(self.compute_dtype)

    def _dense(self) -> tuple[torch.Tensor, bool]:
        """(a weight oneDNN / F.linear take, whether oneDNN takes it)."""
        if self.packed is not None:
            return self.packed, True
        if self.weight is not None:
            return self.weight.to(self.compute_dtype), self._onednn_plain
        return skinny_gemm.kernel().unpack_float(self.skinny, self.out_features), self._onednn_plain  # bf16 widened

    def _run(self, x: torch.Tensor, epilogue: str, other: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b, then the epilogue ("none", "silu", "mul" or "add" other), by the fastest path."""
        if (self.skinny is not None or self.quant is not None) and x.shape[0] <= self.skinny_rows:
            return self._skinny(x, skinny_gemm.ACT.get(epilogue, 0), other, skinny_gemm.BIN.get(epilogue, 0))
        w, onednn = self._dense()
        if onednn:
            if other is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, w, self.bias, epilogue)
            return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, _ONEDNN_ACT[epilogue], [], "")
        y = F.linear(x, w, self.bias)
        return {"none": y, "silu": F.silu(y)}[epilogue] if other is None else getattr(y, epilogue + "_")(other)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, "none")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W.T + b), the activation fused into the GEMM's epilogue."""
        return self._run(x, "silu")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) * other, fused (SwiGLU's up projection times silu(gate))."""
        return self._run(x, "mul", other)

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) + other, fused (a residual connection)."""
        return self._run(x, "add", other)
