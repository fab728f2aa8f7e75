"""``models/packed_attention.py`` against SDPA with the dense mask, directly: documents of many lengths in one row
(several padded-length buckets, a 1-token document, documents longer and shorter than the window), grouped-query
heads, forward and gradients (fp32), and under bfloat16 autocast."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from thinpipe.models.families import sliding_window_mask
from thinpipe.models.packed_attention import Documents, dense_mask, packed_attention

LENGTHS = [[1, 5, 17, 33, 70, 2], [70, 33, 17, 5, 1, 2]]  # two rows of 128 tokens, the lengths in other orders


def reference(q, k, v, seg, window):
    mask = dense_mask(seg)
    if window is not None:
        mask = sliding_window_mask(mask, window)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("window", [None, 4, 16])
def test_every_document_length_and_window_equals_the_dense_mask(window):
    seg = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 128, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    got, _ = packed_attention(SimpleNamespace(), q, k, v, Documents.from_segments(seg).with_window(window))
    want = reference(q, k, v, seg, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = torch.randn(got.shape, generator=g)
    dg = torch.autograd.grad((got * w).sum(), (q, k, v))
    dw = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(dg, dw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unpacked_rows_and_bfloat16_autocast():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g) for _ in range(3))
    seg = torch.zeros(2, 40, dtype=torch.int64)
    got, _ = packed_attention(SimpleNamespace(), q, k, v, Documents.from_segments(seg))
    torch.testing.assert_close(got, reference(q, k, v, seg, None), rtol=1e-5, atol=1e-5)
    packed = torch.tensor([[0] * 13 + [1] * 27, [0] * 40])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packed_attention(SimpleNamespace(), q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                  Documents.from_segments(packed))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v, packed, None), rtol=2e-2, atol=2e-2)


def test_a_tensor_mask_goes_to_transformers_sdpa_unchanged():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    got, _ = packed_attention(SimpleNamespace(is_causal=True), q, k, v, mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2))
