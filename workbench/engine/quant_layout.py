"""A GGUF model's own quantized blocks, kept for the decode-sized linears (lossless).

A GGUF file stores SmolLM2's linears as Q4_1 (the embedding / tied vocab head as Q8_0); the
loader dequantizes them to float32 as numpy does, d * q (+ m). Those float32 weights carry
4.5 (Q4_1) or 8.5 (Q8_0) bits each, so the skinny GEMM can stream them (a byte a weight
plus the group's fp16 scales) and widen them in registers to the *same* float32 values
(csrc/quant_layout.h says why it is exact): a decode step then reads ~3.5x fewer weight
bytes in a float32 run and computes what the dense float32 weights compute, bit for bit.

`Linear` only takes a layout whose widening reproduces its float32 weight exactly (checked at
load, bit for bit, against the loader's own dequantization); anything else keeps the dense
layout. EngineConfig.quant_layout="off" (PAGEDKV_QUANT_LAYOUT=off) turns it off (the dense float32
skinny GEMM then runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import env

QK = 32                                   # inputs per quantization group (GGUF's block size)
FORMATS = {"Q8_0": 1, "Q4_1": 2}          # csrc/quant_layout.h's QuantFormat
_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_1": 4 + QK // 2}   # GGUF's bytes per block of 32
NB = 16                                   # output columns per skinny block


def enabled(setting: str | None = None) -> bool:
    """EngineConfig.quant_layout as given; None (a caller without a config): PAGEDKV_QUANT_LAYOUT's."""
    return (env.value("PAGEDKV_QUANT_LAYOUT") if setting is None else setting) != "off"


def describe(kernel_built: bool, setting: str | None = None) -> str:
    """One line for `kvwb doctor`: whether float32 decode streams a GGUF's own blocks."""
    if not enabled(setting):
        return "GGUF block layout off (PAGEDKV_QUANT_LAYOUT=off): float32 decode streams float32 weights"
    if not kernel_built:
        return "GGUF block layout unavailable (no skinny GEMM): float32 decode streams float32 weights"
    return ("GGUF block layout on: float32 decode streams a GGUF's Q4_1 / Q8_0 blocks where they "
            "widen to its weights bit for bit")


@dataclass(frozen=True)
class QuantBlocks:
    """One weight's blocks as the file stores them: rows in the state dict's order."""
    qtype: str              # "Q8_0" or "Q4_1"
    blocks: np.ndarray      # uint8 [rows, K / 32, bytes per block]

    @staticmethod
    def from_gguf(qtype: str, data: np.ndarray, rows: int, k: int) -> QuantBlocks | None:
        """From a GGUF tensor's bytes ([rows, row bytes]); None for a type kept dense only."""
        if qtype not in FORMATS or k % QK:
            return None
        # a copy: the tensor is a view into the file's read-only mapping
        return QuantBlocks(qtype, np.array(data, dtype=np.uint8).reshape(rows, k // QK, _BLOCK_BYTES[qtype]))

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * QK

    @staticmethod
    def cat(parts: list[QuantBlocks | None]) -> QuantBlocks | None:
        """Row-concatenated (the fused qkv projection), when every part has the same type."""
        if any(p is None for p in parts) or len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        return QuantBlocks(parts[0].qtype, np.concatenate([p.blocks for p in parts]))


def pack(q: QuantBlocks) -> tuple[torch.Tensor, int]:
    """(Wq uint8 [ceil(N/16), K/32, group bytes], format) in csrc/quant_layout.h's layout."""
    n, k = q.shape
    g, nb = k // QK, -(-n // NB)
    b = torch.zeros((nb * NB, g, q.blocks.shape[2]), dtype=torch.uint8)       # padded rows: d = m = 0
    b[:n] = torch.from_numpy(q.blocks)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(nb, NB, g).transpose(1, 2)    # [nb, g, 16]
    parts = [d.contiguous().view(torch.uint8)]
    if q.qtype == "Q4_1":
        parts.append(b[..., 2:4].contiguous().view(torch.float16).reshape(nb, NB, g).transpose(1, 2).contiguous().view(torch.uint8))
        qs = b[..., 4:]                                                           # [N, g, 16]: k and k + 16
        vals = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                            # [N, g, 32], k order
    else:
        vals = b[..., 2:]                                                         # int8 bytes [N, g, 32]
    parts.append(vals.reshape(nb, NB, g, QK).permute(0, 2, 3, 1).reshape(nb, g, QK * NB))   # [nb, g, 32 k x 16]
    return torch.cat(parts, dim=-1).contiguous(), FORMATS[q.qtype]
