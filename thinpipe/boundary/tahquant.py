"""TAH-Quant (He et al. 2025, "TAH-Quant: effective activation quantization in pipeline
parallelism over slow network"): tile-wise adaptive quantisation with a Hadamard transform on
outlier tiles, and no per-example memory (unlike AQ-SGD).

Forward, per tile of G = ``quant_group`` consecutive hidden dims of one token (our reading of the
paper's three parts; the choices it leaves open are ours and named here):

1. outlier suppression: a tile whose absmax exceeds ``tah_outlier_ratio`` x its RMS is an outlier
   tile; its pivot (the largest-magnitude element) is swapped to position 0 and the tile is rotated
   by the orthonormal Hadamard matrix H_G / sqrt(G), which spreads the pivot's energy evenly over
   the G entries (G must be a power of two);
2. entropy-guided bit allocation: every tile is quantised at b = ``fwd_bits``; the fraction
   ``tah_high_fraction`` of tiles whose b-bit code histogram has the highest entropy (the tiles
   using their levels most evenly, where a coarse grid loses most) gets b + 1 bits instead;
3. asymmetric uniform quantisation per tile (quant.py: bf16 offset and step).

Per tile one uint8 of side information crosses: bit 7 = the tile has b + 1 bits, bits 0-6 = its
pivot + 1 if it was rotated (0 if not), so G <= 64. The backward quantises the activation gradient
tile-wise at ``bwd_bits`` without rotation or adaptation (quant.py).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from thinpipe.boundary.base import Payload, implements
from thinpipe.boundary.quant import (
    SCALE_BYTES,
    QuantBoundary,
    dequantize,
    pack_bits,
    packed_bytes,
    quantize,
    unpack_bits,
)
from thinpipe.config.boundary_kinds import TahQuantKind

HIGH_BIT = 128


def hadamard_butterfly(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform along the last dim (a power of two) by log2(n) butterfly
    passes: H x / sqrt(n). H / sqrt(n) is symmetric and orthogonal, so applying it twice gives x back."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n))


@lru_cache(maxsize=16)
def _hadamard_matrix(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return hadamard_butterfly(torch.eye(n, dtype=dtype, device=device))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The same transform as one matmul with the cached H / sqrt(n) (symmetric, so x H = H x per row):
    9x faster than the butterfly on this CPU for 64-dim tiles, and on SmolLM2-sized data the 1- and
    4-bit Lloyd-Max codes of both agree bitwise (``benchmarks/codec_cost.py``, issue 36)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
    return (x.reshape(-1, n) @ _hadamard_matrix(n, x.dtype, str(x.device))).reshape(x.shape)


def code_entropy(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Shannon entropy (bits) of each row's code histogram."""
    counts = torch.zeros(codes.shape[0], 2 ** bits, device=codes.device).scatter_add_(
        1, codes, torch.ones_like(codes, dtype=torch.float))
    p = counts / codes.shape[1]
    return -(p * torch.log2(p.clamp_min(1e-12))).sum(1)


@implements(TahQuantKind)
class TahQuantBoundary(QuantBoundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        own = cfg.settings()
        return cls(index, hidden_size, *cfg.bits(), cfg.quant_group, own.high_fraction, own.outlier_ratio, wire_dtype)

    def __init__(self, index: int, hidden_size: int, fwd_bits: int, bwd_bits: int, group: int,
                 high_fraction: float, outlier_ratio: float, wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, fwd_bits, bwd_bits, group, wire_dtype)
        if self.group & (self.group - 1) or self.group > 64:
            raise ValueError("tahquant tiles must be a power of two <= 64 dims (boundary.quant_group), "
                             f"got {self.group}")
        if fwd_bits >= 8:
            raise ValueError(f"tahquant forward bits must be < 8 (outlier tiles get one more), got {fwd_bits}")
        self.high_fraction, self.outlier_ratio = high_fraction, outlier_ratio

    def high_tiles(self, tiles: int) -> int:
        return int(round(self.high_fraction * tiles))

    # sender ---------------------------------------------------------------------------------------
    def encode(self, x, ctx):
        G, b = self.group, self.fwd_bits
        t = x.detach().float().reshape(-1, G).clone()
        rms = t.pow(2).mean(1).sqrt()
        absmax, pivot = t.abs().max(1)
        rotate = absmax > self.outlier_ratio * rms.clamp_min(1e-30)
        meta = torch.zeros(t.shape[0], dtype=torch.uint8, device=t.device)
        if rotate.any():
            r = t[rotate]
            p = pivot[rotate]
            rows = torch.arange(r.shape[0], device=t.device)
            first = r[:, 0].clone()
            r[:, 0] = r[rows, p]
            r[rows, p] = first
            t[rotate] = hadamard(r)
            meta[rotate] = (p + 1).to(torch.uint8)
        codes, lo, step = quantize(t, b, G)
        high = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
        n_high = self.high_tiles(t.shape[0])
        if n_high:
            high[code_entropy(codes, b).topk(n_high).indices] = True
            codes_hi, lo_hi, step_hi = quantize(t[high], b + 1, G)
            lo, step = lo.clone(), step.clone()
            lo[high], step[high] = lo_hi, step_hi
            meta[high] |= HIGH_BIT
        payload = {"meta": meta, "offset": lo, "step": step, "codes": pack_bits(codes[~high], b)}
        if n_high:
            payload["codes_hi"] = pack_bits(codes_hi, b + 1)
        return x, Payload(payload)

    # receiver -------------------------------------------------------------------------------------
    def decode(self, payload, ctx):
        G, b = self.group, self.fwd_bits
        p = payload.tensors
        meta = p["meta"]
        high = (meta & HIGH_BIT).bool()
        tiles = meta.shape[0]
        t = torch.empty(tiles, G, device=meta.device)
        lo, step = p["offset"], p["step"]
        low = ~high
        t[low] = dequantize(unpack_bits(p["codes"], b, int(low.sum()) * G).reshape(-1, G), lo[low], step[low],
                            (int(low.sum()), G))
        if high.any():
            t[high] = dequantize(unpack_bits(p["codes_hi"], b + 1, int(high.sum()) * G).reshape(-1, G), lo[high],
                                 step[high], (int(high.sum()), G))
        pivot = (meta & (HIGH_BIT - 1)).to(torch.int64) - 1
        rotated = pivot >= 0
        if rotated.any():
            r = hadamard(t[rotated])
            pv = pivot[rotated]
            rows = torch.arange(r.shape[0], device=r.device)
            first = r[:, 0].clone()
            r[:, 0] = r[rows, pv]
            r[rows, pv] = first
            t[rotated] = r
        return t.reshape(*ctx.input_ids.shape, self.hidden_size)

    # accounting -----------------------------------------------------------------------------------
    def expected_bytes(self, tokens, element_size):
        G, b = self.group, self.fwd_bits
        tiles = tokens * self.hidden_size // G
        hi = self.high_tiles(tiles)
        fwd = packed_bytes((tiles - hi) * G, b) + packed_bytes(hi * G, b + 1) + tiles * (SCALE_BYTES + 1)
        return fwd, super().expected_bytes(tokens, element_size)[1]
