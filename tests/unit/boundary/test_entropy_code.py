"""Entropy-coded uniform quantisation (boundary/entropy_code.py, issue 52): exact decoding, coded lengths at the
model's entropy, the dithered error uniform and independent of the signal, malformed payloads refused."""

import pytest
import torch

from thinpipe.boundary.entropy_code import (
    decode,
    dequantise,
    dither,
    encode,
    entropy_bits,
    index_spread,
    max_coded_bytes,
    quantise,
)
from thinpipe.comm.header import PayloadError


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("step", [0.25, 0.6, 1.5])
@pytest.mark.parametrize("dithered", [False, True])
def test_indices_decode_exactly_in_about_their_entropy(step, dithered):
    x = gaussian(20_000)
    u = dither(x.shape, 7) if dithered else None
    q = quantise(x, torch.tensor(step), u)
    spread = index_spread(torch.tensor(step), dithered)
    data = encode(q, spread)
    assert torch.equal(decode(data, spread, tuple(q.shape), "test"), q)
    bits = 8 * data.numel() / x.numel()
    assert bits == pytest.approx(entropy_bits(step, dithered), rel=0.03, abs=0.01)
    assert data.numel() <= max_coded_bytes(x.numel())


def test_the_dithered_error_is_uniform_and_independent_of_the_signal_unlike_plain_rounding():
    x, step = gaussian(50_000) * 2.0, torch.tensor(1.5)
    u = dither(x.shape, 3)
    assert torch.equal(u, dither(x.shape, 3)) and not torch.equal(u, dither(x.shape, 4))  # a PRF: both ends alike
    err = dequantise(quantise(x, step, u), step, u) - x
    assert err.abs().max() <= step / 2 + 1e-6
    assert float(err.pow(2).mean()) == pytest.approx(float(step) ** 2 / 12, rel=0.03)
    assert abs(float((err * x).mean())) < 0.01 and abs(float(err.mean())) < 0.01
    # E[error | x], over 40 bins of x: ~0 with dither; without it the error is a function of x (up to step / 2)
    plain = dequantise(quantise(x, step), step) - x
    bins = ((x + 4) / 8 * 40).clamp(0, 39).long()
    given_x = lambda e: torch.stack([e[bins == b].mean() for b in range(40) if (bins == b).sum() > 300])  # noqa: E731
    assert given_x(err).abs().max() < 0.1 * float(step) and given_x(plain).abs().max() > 0.2 * float(step)


def test_a_cut_padded_altered_or_oversized_payload_is_refused():
    x = gaussian(4_000)
    spread = index_spread(torch.tensor(0.5), True)
    q = quantise(x, torch.tensor(0.5), dither(x.shape, 1))
    data = encode(q, spread)
    altered = data.clone()
    altered[len(data) // 2] ^= 0xFF
    for bad, why in ((data[:-4], "does not decode"), (torch.cat([data, data[:4]]), "does not decode"),
                     (data[4:], "does not decode"), (altered, "does not decode"), (data[:-1], "whole 32-bit words"),
                     (torch.zeros(max_coded_bytes(4_000) + 4, dtype=torch.uint8), "whole 32-bit words")):
        with pytest.raises(PayloadError, match=why):
            decode(bad, spread, tuple(q.shape), "boundary 0")
