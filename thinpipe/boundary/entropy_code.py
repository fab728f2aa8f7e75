"""Entropy coding of quantisation indices on the wire, and the uniform quantiser it codes (issue 52, items 2-4).

A uniform quantiser with step delta spends bits as the entropy of its indices, not as a fixed width: at the same
distortion it saves 0.25-0.4 bit per dimension over fixed-width Lloyd-Max codes at 2-4 bits (ECSQ: Gish & Pierce
1968), and its error has no shrinkage. With *subtractive dither* (Schuchman 1964; Zamir & Feder 1992) the error is
exactly uniform on (-delta/2, delta/2) and independent of the signal: x_hat = delta (round(x / delta + u) - u) with
u ~ U(-1/2, 1/2) drawn by both ends from a PRF, never sent (``dither``). That is the unbiased forward issue 52 asks
for: no Lloyd-Max shrinkage, no deleted directions, only fresh noise of a known power.

The indices are coded with ``constriction``'s range-variant ANS coder (``AnsCoder``, a well-kept Rust library)
under a quantised Gaussian model each end computes from what both know: index q of a component with step delta on
a signal of unit variance has about the spread sqrt(1/delta^2 + 1/12) (the signal over the step, plus the dither's
uniform). The model's leakiness (every index in [-B, B] has a probability of at least 2^-24) makes any index
codable and bounds a payload: at most 24 bits an index (``max_coded_bytes``), which the receiver checks before it
allocates. Decoding is exact. An ANS stream has no structure to check (any words decode to some indices), so a
payload ends with the CRC-32 of its indices (one word, counted in its bytes): a payload cut, padded or altered is
refused in one line, not decoded into other indices.
"""

from __future__ import annotations

import math
import zlib

import constriction
import numpy as np
import torch

from thinpipe.comm.header import PayloadError

INDEX_BOUND = 1 << 15  # indices are clamped to [-B, B]: 2^15 steps is far beyond any activation's range
PRECISION_BITS = 24    # constriction's default model precision: no index costs more than this many bits


def dither(shape: tuple[int, ...], key: int) -> torch.Tensor:
    """Uniform noise on [-1/2, 1/2) of ``shape`` from the PRF key ``key`` (both ends draw the same, bitwise)."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(key & (2 ** 62 - 1))) - 0.5


def quantise(x: torch.Tensor, step: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Indices round(x / step + u) (u: the dither, or None), clamped to the coder's range."""
    y = x / step + (u if u is not None else 0.0)
    return torch.round(y).clamp(-INDEX_BOUND, INDEX_BOUND).to(torch.int64)


def dequantise(q: torch.Tensor, step: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """step (q - u): the reconstruction (with the dither subtracted, unbiased)."""
    return step * (q.to(step.dtype) - (u if u is not None else 0.0))


def index_spread(step: torch.Tensor, dithered: bool) -> torch.Tensor:
    """The model's standard deviation of the indices of a unit-variance signal at ``step``."""
    return torch.sqrt(1.0 / step.pow(2) + (1.0 / 12.0 if dithered else 0.0))


def _model():
    return constriction.stream.model.QuantizedGaussian(-INDEX_BOUND, INDEX_BOUND)


def encode(indices: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """The indices (any shape, int64) entropy coded under N(0, spread) quantised to the integers (``spread``: one
    per index, broadcastable), as a uint8 tensor (whole 32-bit words, little-endian)."""
    q = indices.reshape(-1).to(torch.int32).numpy()
    s = spread.expand_as(indices).reshape(-1).to(torch.float64).numpy()
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(q, _model(), np.zeros_like(s), s)
    return _framed(coder, q)


def _framed(coder, q: np.ndarray) -> torch.Tensor:
    words = np.append(coder.get_compressed(), np.uint32(_crc(q))).astype("<u4", copy=False)
    return torch.from_numpy(words.view(np.uint8).copy())


def _categorical(probabilities: tuple[float, ...]):
    return constriction.stream.model.Categorical(np.asarray(probabilities, dtype=np.float64), perfect=False)


def encode_categorical(codes: torch.Tensor, probabilities: tuple[float, ...]) -> torch.Tensor:
    """Codes in [0, len(probabilities)) (any shape) entropy coded under one fixed categorical model both ends know
    (``outlier.entropy``: the Lloyd-Max cells' probabilities), framed as ``encode``'s (whole words, a CRC word)."""
    q = codes.reshape(-1).to(torch.int32).numpy()
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(q, _categorical(probabilities))
    return _framed(coder, q)


def decode_categorical(data: torch.Tensor, probabilities: tuple[float, ...], count: int, what: str) -> torch.Tensor:
    """The ``count`` codes ``encode_categorical`` coded into ``data`` (int64), refused in one line as ``decode``'s."""
    return _decoded(data, count, what, lambda coder: coder.decode(_categorical(probabilities), count))


def _crc(q: np.ndarray) -> int:
    return zlib.crc32(q.astype("<i4", copy=False).tobytes())


def decode(data: torch.Tensor, spread: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """The indices ``encode`` coded into ``data`` (``shape``, int64, under the same ``spread``); a payload that is
    not whole words, or that does not decode to exactly its end, is refused in one line naming ``what``."""
    s = spread.expand(shape).reshape(-1).to(torch.float64).numpy()
    return _decoded(data, math.prod(shape), what, lambda coder: coder.decode(_model(), np.zeros_like(s), s)).reshape(
        shape)


def _decoded(data: torch.Tensor, n: int, what: str, decode_with) -> torch.Tensor:
    """The n indices of a framed stream (1-D int64): its words checked before the coder reads them, its CRC after."""
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4 or data.numel() > max_coded_bytes(n):
        raise PayloadError(f"{what}: an entropy-coded payload of {data.numel()} bytes is not whole 32-bit words of at "
                           f"most {max_coded_bytes(n)} bytes")
    words = data.numpy().view("<u4").astype(np.uint32)
    if words.size < 2:
        raise PayloadError(f"{what}: an entropy-coded payload of {data.numel()} bytes holds no coded indices")
    try:
        coder = constriction.stream.stack.AnsCoder(words[:-1].copy())
        q = np.asarray(decode_with(coder), dtype=np.int32).reshape(-1)
        exact = coder.is_empty() and _crc(q) == int(words[-1])
    except Exception as e:  # constriction raises on a stream it cannot decode
        raise PayloadError(f"{what}: the entropy-coded payload does not decode ({type(e).__name__})") from None
    if not exact:
        raise PayloadError(f"{what}: the entropy-coded payload does not decode to its indices (cut, padded or "
                           "altered: its CRC-32 differs)")
    return torch.from_numpy(q.astype(np.int64))


def max_coded_bytes(indices: int) -> int:
    """An upper bound on ``encode``'s bytes for ``indices`` indices: ``PRECISION_BITS`` each, in 32-bit words, plus
    the coder's initial state (two words) and the CRC (one)."""
    return 4 * (math.ceil(indices * PRECISION_BITS / 32) + 3)


def categorical_bits(probabilities: tuple[float, ...]) -> float:
    """Bits per code a categorical model expects of codes drawn from it (its entropy)."""
    return -sum(p * math.log2(p) for p in probabilities if p > 0)


def entropy_bits(step: float, dithered: bool) -> float:
    """Bits per index the model expects for a unit-variance Gaussian at ``step`` (its quantised Gaussian's
    entropy): what a rate allocation spends."""
    s = math.sqrt(1.0 / step ** 2 + (1.0 / 12.0 if dithered else 0.0))
    k = torch.arange(-int(12 * s) - 2, int(12 * s) + 3, dtype=torch.float64)
    p = (torch.special.ndtr((k + 0.5) / s) - torch.special.ndtr((k - 0.5) / s)).clamp_min(1e-300)
    return float(-(p * p.log2()).sum())
