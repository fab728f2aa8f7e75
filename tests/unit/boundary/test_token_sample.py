"""The token-sparse backward's draw (boundary/token_sample.py; issue 52): ``sample`` keeps exactly K tokens, each
with its probability pi_i = min(1, c ||g_i||) (checked against a fine grid of the one uniform), so the scaled
gradient it sends is an unbiased estimate of the whole; ``top`` is the old deterministic rule."""

import pytest
import torch

from thinpipe.boundary import OutlierBoundary
from thinpipe.boundary.token_sample import inclusion, select_tokens, systematic
from thinpipe.comm.header import spec_of
from thinpipe.rank.context import make_contexts

H = 64


def ctx_at(step: int, batch: int = 2, seq: int = 16):
    labels = torch.zeros(batch, seq, dtype=torch.long)
    return make_contexts({"input_ids": torch.zeros_like(labels), "labels": labels,
                          "segment_ids": torch.zeros_like(labels)}, 1, step, 0)[0]


def test_inclusion_probabilities_are_capped_proportional_shares_summing_to_k():
    w = torch.tensor([100.0, 50.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0])
    pi = inclusion(w, 3)
    # the two heavy tokens are certain; the third slot is shared by the rest in proportion: 4 / 10, 3 / 10, ...
    assert pi.tolist() == pytest.approx([1.0, 1.0, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    torch.manual_seed(0)
    w = torch.rand(200).pow(6)
    pi = inclusion(w, 70)
    free = pi < 1
    assert float(pi.sum()) == pytest.approx(70) and bool((pi <= 1).all())
    assert float(w[~free].min()) >= float(w[free].max())  # only the largest are capped
    ratio = pi[free] / w[free]
    assert float(ratio.max() - ratio.min()) < 1e-9 * float(ratio.max())  # the rest: one constant of proportion


def test_systematic_sampling_keeps_exactly_k_each_with_its_probability():
    torch.manual_seed(1)
    pi = inclusion(torch.rand(48).pow(3), 16)
    grid = (torch.arange(40_000, dtype=torch.float64) + 0.5) / 40_000  # u over [0, 1), evenly
    kept = torch.stack([systematic(pi, float(u)) for u in grid])
    assert set(kept.sum(1).tolist()) == {16}
    assert float((kept.double().mean(0) - pi).abs().max()) < 1e-4  # exactly pi_i, up to the grid's resolution


def test_the_sampled_gradient_is_unbiased_and_top_k_is_not():
    """Over the draws of many steps, the decoded sampled gradient (codes off: the scaled rows themselves) averages
    to the whole gradient; top-K's misses the small tokens every time."""
    torch.manual_seed(2)
    g = torch.randn(32, 8) * torch.linspace(0.05, 2.0, 32).unsqueeze(1)
    sq = g.pow(2).sum(1)
    mean = torch.zeros_like(g)
    for step in range(4000):
        keep, factor = select_tokens(sq, 8, "sample", (0, 1, step, 0, 0))
        assert int(keep.sum()) == 8
        mean += torch.where(keep.unsqueeze(1), g * factor.unsqueeze(1), 0.0)
    mean /= 4000
    assert float((mean - g).norm() / g.norm()) < 0.03
    keep, factor = select_tokens(sq, 8, "top", (0, 1, 0, 0, 0))
    assert bool((factor == 1).all()) and keep.nonzero().flatten().tolist() == sorted(sq.topk(8).indices.tolist())
    top = torch.where(keep.unsqueeze(1), g, 0.0)  # the same every step: its mean misses the other 24 tokens
    assert float((top - g).norm() / g.norm()) > 0.3
    # every token with a gradient fits: kept as they are
    few = torch.zeros(32).index_fill_(0, torch.tensor([3, 9]), 1.0)
    keep, factor = select_tokens(few, 8, "sample", (0, 1, 0, 0, 0))
    assert bool(keep[[3, 9]].all()) and int(keep.sum()) == 8 and bool((factor == 1).all())


def test_the_sampled_backward_costs_the_same_bytes_and_draws_per_step():
    """Through the outlier kind: the same payload spec and bytes as ``top``; the kept rows arrive scaled by
    1 / pi in their per-token scale; the same context draws the same tokens, another step others."""
    torch.manual_seed(3)
    g = torch.randn(2, 16, H) * torch.linspace(0.1, 3, 32).reshape(2, 16, 1)
    top = OutlierBoundary(0, H, 2, 2, 1, 16, grid="lloyd-max", bwd_scale_group=-1, bwd_tokens=0.5)
    sample = OutlierBoundary(0, H, 2, 2, 1, 16, grid="lloyd-max", bwd_scale_group=-1, bwd_tokens=0.5,
                             bwd_select="sample", seed=7)
    ctx = ctx_at(0)
    p_top, p = top.encode_grad(g, ctx), sample.encode_grad(g, ctx)
    assert p.nbytes == p_top.nbytes == sample.expected_bytes(32, 4)[1]
    sample.payload_expect("bwd", 32).check(spec_of(p), "test")
    g_hat = sample.decode_grad(p, ctx).reshape(32, H)
    kept = g_hat.abs().sum(1) > 0
    pi = inclusion(g.reshape(32, H).norm(dim=1).double(), 16)
    rms = g.reshape(32, H)[kept].pow(2).mean(1).sqrt() / pi[kept].float()
    assert g_hat[kept].pow(2).mean(1).sqrt() == pytest.approx(rms * 0.7979, rel=0.02)  # 1-bit Lloyd-Max level
    assert torch.equal(sample.encode_grad(g, ctx).tensors["tokens"], p.tensors["tokens"])
    others = {bytes(sample.encode_grad(g, ctx_at(s)).tensors["tokens"].tolist()) for s in range(1, 9)}
    assert len(others) > 1
