"""Transform coding in a fitted basis (issue 36; the ``klt`` boundary's math, ``klt.py``): reverse
water-filling of whole bits over the KLT components, Lloyd-Max codes of the coefficients with one
scale per row and bit width, the start's basis in 8 bits, and which tokens the loss scores. Plain
functions on tensors; both ends of a boundary call them on the same values, so they agree bitwise.

References: Cover & Thomas, Elements of Information Theory, §10.3.3 (reverse water-filling over
independent Gaussian components); Fox 1966, "Discrete optimization via marginal analysis" (greedy
allocation is optimal for convex distortion curves); Max 1960 (the Lloyd-Max grid, ``lloyd_max.py``).
"""

from __future__ import annotations

import heapq
import math

import torch

from thinpipe.boundary.lloyd_max import SCALE_DTYPE, gaussian_distortion, gaussian_levels
from thinpipe.boundary.quant import pack_bits, packed_bytes, unpack_bits

MAX_BITS = 8
BASIS_DTYPE = torch.bfloat16


def allocate_bits(variances: torch.Tensor, mean_bits: float, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Whole bits per component (int64, same order as ``variances``) summing to round(mean_bits x d):
    reverse water-filling on the Lloyd-Max distortion curve D(b) of N(0, 1), one bit at a time to
    the component whose distortion lambda_i D(b_i) drops most (ties: the lower index)."""
    d = variances.numel()
    total = min(round(mean_bits * d), max_bits * d)
    drop = [1.0 - gaussian_distortion(1)] + [gaussian_distortion(b) - gaussian_distortion(b + 1)
                                             for b in range(1, max_bits)]
    lam = [float(v) for v in variances]
    bits = [0] * d
    heap = [(-lam[i] * drop[0], i) for i in range(d)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        bits[i] += 1
        if bits[i] < max_bits:
            heapq.heappush(heap, (-lam[i] * drop[bits[i]], i))
    return torch.tensor(bits, dtype=torch.int64)


def fit_moments(mean: torch.Tensor, cov: torch.Tensor, budgets: tuple[float, ...]):
    """The KLT of a (mean, covariance): (mean, basis (d, m), sqrt(lambda) (m,), one bits table (m,) per
    budget), in the wire's dtypes, m = the components any table codes (the eigenvalues' descending prefix)."""
    lam, vec = torch.linalg.eigh(cov.double())  # ascending
    lam, vec = lam.flip(0).clamp_min(0.0), vec.flip(1)
    tables = [allocate_bits(lam, b) for b in budgets]
    m = max(max(int((t > 0).sum()) for t in tables), 1)
    std = lam[:m].sqrt().clamp_min(1e-12).to(BASIS_DTYPE)
    return mean.to(BASIS_DTYPE), vec[:, :m].to(BASIS_DTYPE).contiguous(), std, [t[:m].to(torch.uint8) for t in tables]


def int8_columns(basis: torch.Tensor) -> dict[str, torch.Tensor]:
    """The start's basis in 8 bits: each column's codes round(u / s) in [-127, 127] and its bf16 step s
    (absmax / 127, rounded up so no code clips). Both ends code with the same dequantised basis."""
    step = (basis.abs().amax(0) / 127).clamp_min(1e-30)
    step = torch.where(step.to(BASIS_DTYPE).float() < step, torch.nextafter(step.to(BASIS_DTYPE),
                                                                           torch.tensor(1.0, dtype=BASIS_DTYPE)),
                       step.to(BASIS_DTYPE))
    codes = (basis / step.float()).round().clamp(-127, 127).to(torch.int8)
    return {"basis": codes, "basis_scale": step}


def widths(bits: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(k, the components coded at k bits) of a bits table, k ascending, k > 0."""
    b = bits.to(torch.int64)
    return [(k, (b == k).nonzero().flatten()) for k in range(1, MAX_BITS + 1) if bool((b == k).any())]


def code(z: torch.Tensor, bits: torch.Tensor, per_width: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, m) coefficients in units of their standard deviation -> (bf16 RMS scales (n, widths) of each
    row's components of each width, or (n, 1) one per row over every coded component; the Lloyd-Max
    codes of z / scale packed per width, byte-aligned, widths ascending)."""
    ws = widths(bits)
    if per_width:
        scale = torch.stack([z[:, cols].pow(2).mean(1).sqrt() for _, cols in ws], 1).to(SCALE_DTYPE)
    else:
        coded = torch.cat([cols for _, cols in ws])
        scale = z[:, coded].pow(2).mean(1).sqrt().to(SCALE_DTYPE)[:, None]
    s = scale.float().clamp_min(torch.finfo(torch.float32).tiny)
    chunks = []
    for j, (k, cols) in enumerate(ws):
        levels = torch.tensor(gaussian_levels(k), dtype=torch.float32, device=z.device)
        q = z[:, cols] / s[:, j if per_width else 0, None]
        chunks.append(pack_bits(torch.bucketize(q, (levels[1:] + levels[:-1]) / 2), k))
    return scale, torch.cat(chunks)


def uncode(scale: torch.Tensor, codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Inverse of ``code``: (n, m) coefficients in units of their standard deviation (uncoded: 0)."""
    n = scale.shape[0]
    z = torch.zeros(n, bits.numel(), device=codes.device)
    at = 0
    for j, (k, cols) in enumerate(widths(bits)):
        levels = torch.tensor(gaussian_levels(k), dtype=torch.float32, device=codes.device)
        count = n * cols.numel()
        chunk = codes[at:at + packed_bytes(count, k)]
        at += chunk.numel()
        s = scale[:, j if scale.shape[1] > 1 else 0].float()
        z[:, cols] = levels[unpack_bits(chunk, k, count).reshape(n, cols.numel())] * s[:, None]
    return z


def codes_bytes(rows: int, bits: torch.Tensor) -> int:
    return sum(packed_bytes(rows * cols.numel(), k) for k, cols in widths(bits))


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def spec_bytes(spec: dict) -> int:
    """The bytes of a payload spec (name: (shape, dtype))."""
    return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in spec.values())


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose output is scored by the next-token loss (labels[t + 1] set)."""
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    return scored
