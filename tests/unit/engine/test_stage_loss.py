"""The last stage's loss: ``next_token_loss`` is ``cross_entropy`` of the shifted logits, bitwise, in value and
gradient (it only avoids copying the vocabulary-sized logits)."""

import pytest
import torch
import torch.nn.functional as F

from thinpipe.models.stages import next_token_loss


@pytest.mark.parametrize("shape", [(2, 7, 11), (4, 64, 1000), (1, 3, 5)])
@pytest.mark.parametrize("ignored", [0.0, 0.4, 1.0])
def test_next_token_loss_is_the_shifted_cross_entropy_bitwise(shape, ignored):
    b, t, v = shape
    g = torch.Generator().manual_seed(b * t + int(10 * ignored))
    logits = torch.randn(b, t, v, generator=g) * 3
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < ignored] = -100
    ref_in, new_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100,
                          reduction="sum")
    new = next_token_loss(new_in, labels)
    up = torch.randn((), generator=g)  # a loss scale upstream
    (ref * up).backward()
    (new * up).backward()
    assert torch.equal(ref, new)
    assert torch.equal(ref_in.grad, new_in.grad)
