"""The Lloyd-Max grid: b-bit codes of a unit Gaussian, scaled per group by its RMS (not in either
paper; measured in experiments/frontier/README.md).

Why: after the Hadamard rotation a token's activation (outliers removed) or activation gradient is
close to Gaussian, and a min/max-scaled uniform grid (quant.py) wastes its levels at 1-2 bits: its
end levels sit on the group's extremes (~ +-2.4 sigma for 64 values), so at 1 bit every value is
sent as +-2.4 sigma (relative MSE ~2.9, worse than sending zeros) and at 2 bits the inner levels are
1.6 sigma apart (relative MSE ~0.2). The Lloyd-Max quantiser of N(0, 1) (Max 1960, "Quantizing for
minimum distortion") places the 2^b levels at the centroids of their cells, whose edges are the
midpoints between levels: relative MSE 0.363 / 0.1175 / 0.0345 / 0.0095 at 1 / 2 / 3 / 4 bits.
Scaling by the group's RMS (one bf16 value per group, 2 B: half of min/max's offset and step) fits it
to each token's size.

Codes are bit-packed with ``quant.pack_bits``; a group is ``group`` consecutive values.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

SCALE_DTYPE = torch.bfloat16
RMS_SCALE_BYTES = 2  # one bf16 RMS per group


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@lru_cache(maxsize=None)
def gaussian_levels(bits: int) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending (Lloyd's iteration to a fixed point: each
    level is the centroid of its cell, each cell edge the midpoint of its two levels)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    n = 2 ** bits
    levels = [-3.0 + 6.0 * (i + 0.5) / n for i in range(n)]
    for _ in range(10_000):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = [(_phi(lo) - _phi(hi)) / max(_cdf(hi) - _cdf(lo), 1e-300) for lo, hi in zip(edges, edges[1:])]
        done = max(abs(a - b) for a, b in zip(new, levels)) < 1e-12
        levels = new
        if done:
            break
    return tuple(levels)


@lru_cache(maxsize=None)
def gaussian_distortion(bits: int) -> float:
    """The relative MSE of the ``bits``-bit Lloyd-Max quantiser of N(0, 1): 1 - E[q(x)^2], since each
    level is its cell's centroid (E[x q(x)] = E[q(x)^2]); 0.3634 / 0.1175 / 0.03454 / 0.009497 at 1-4 bits."""
    levels = gaussian_levels(bits)
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    return 1.0 - sum(c * c * (_cdf(hi) - _cdf(lo)) for c, lo, hi in zip(levels, edges, edges[1:]))


@lru_cache(maxsize=None)
def gaussian_cell_probabilities(bits: int) -> tuple[float, ...]:
    """The probability of each of the ``bits``-bit Lloyd-Max cells under N(0, 1), ascending: what an entropy coder
    of the codes assumes (``outlier.entropy``); their entropy is 1 / 1.911 / 2.825 / 3.765 bits at 1-4 bits."""
    levels = gaussian_levels(bits)
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    return tuple(_cdf(hi) - _cdf(lo) for lo, hi in zip(edges, edges[1:]))


def _tables(bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    levels = torch.tensor(gaussian_levels(bits), dtype=torch.float32, device=device)
    return levels, (levels[1:] + levels[:-1]) / 2


def quantize_rms(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., H) -> (codes (N, group) int64 in [0, 2^bits), scale (N,) bf16): each group's RMS, and
    the nearest Lloyd-Max level of each value / RMS. An all-zero group gets scale 0 (decodes to 0)."""
    g = x.detach().float().reshape(-1, group)
    scale = g.pow(2).mean(1).sqrt().to(SCALE_DTYPE)
    s = scale.float().clamp_min(torch.finfo(torch.float32).tiny)
    _, edges = _tables(bits, g.device)
    return torch.bucketize(g / s[:, None], edges), scale


def dequantize_rms(codes: torch.Tensor, scale: torch.Tensor, bits: int, shape) -> torch.Tensor:
    levels, _ = _tables(bits, codes.device)
    return (levels[codes] * scale.float()[:, None]).reshape(shape)
