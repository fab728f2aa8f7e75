"""Masks keyed by (seed, boundary, row key) and token position (RL: a sequence draws the same masks in every
forward of it, whatever its microbatch; paper §3.1's PRF, keyed per sequence)."""

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import config
from thinpipe.boundary import MaskBoundary
from thinpipe.boundary.prf import keep_indices, keep_indices_rows, prf_key
from thinpipe.config import ConfigError

H = 64


def ctx(keys, positions, step=3, microbatch=0, replica=0):
    return SimpleNamespace(step=step, microbatch=microbatch, replica=replica, row_keys=torch.tensor(keys),
                           position_ids=positions)


def test_a_row_draws_the_same_masks_in_any_layout():
    b = MaskBoundary(1, H, p=0.9, seed=7)
    keys = [11, 22, 33, 44]
    pos = torch.arange(6).expand(4, 6)
    whole = b._flat_indices((4, 6), ctx(keys, pos), "cpu")
    # rows 2..3 alone, in another microbatch and replica: the same masks
    part = b._flat_indices((2, 6), ctx(keys[2:], pos[2:], microbatch=5, replica=1), "cpu")
    assert torch.equal(whole[2:], part)
    # a left-padded row (positions shifted right by two columns) keeps its tokens' masks
    shifted = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.arange(6).view(1, 6)], dim=1)
    padded = b._flat_indices((1, 8), ctx(keys[1:2], shifted), "cpu")
    assert torch.equal(padded[0, 2:], whole[1])
    # one token at a time (a decode step) draws what the whole row draws at that position
    one = b._flat_indices((1, 1), ctx(keys[3:], torch.tensor([[4]])), "cpu")
    assert torch.equal(one[0, 0], whole[3, 4])


def test_row_masks_are_exactly_k_and_differ_by_key_and_position():
    idx = keep_indices_rows([1, 2], torch.arange(50).expand(2, 50), H, 8)
    assert idx.shape == (2, 50, 8) and (idx.diff(dim=-1) > 0).all()
    assert not torch.equal(idx[0], idx[1])
    assert len({tuple(r.tolist()) for r in idx[0]}) > 40  # positions draw (nearly) distinct masks


def test_row_masks_match_the_flat_prf_of_the_same_key():
    """The row form is the flat PRF of one key per row, its token index the position."""
    key = prf_key(5, 9)
    flat = keep_indices(key, 12, H, 8)
    rows = keep_indices_rows([key], torch.arange(12).view(1, 12), H, 8)[0]
    assert torch.equal(flat, rows)


def test_sft_keeps_its_microbatch_keys():
    b = MaskBoundary(0, H, p=0.9, seed=7)
    c = SimpleNamespace(step=2, microbatch=1, replica=0, row_keys=None, position_ids=torch.arange(5).expand(2, 5))
    assert torch.equal(b._flat_indices((2, 5), c, "cpu").view(10, -1),
                       keep_indices(prf_key(7, 0, 2, 1, 0), 10, H, b.keep))


@pytest.mark.parametrize("sets, words", [
    ({"train.objective": "gspo", "train.seq_len": 64}, "max_response_tokens"),
    ({"train.objective": "gspo", "rl.max_response_tokens": 8, "train.microbatches": 2}, "microbatches"),
    ({"train.objective": "gspo", "rl.max_response_tokens": 8, "rl.minibatches": 3}, "does not divide"),
    ({"train.objective": "gspo", "rl.max_response_tokens": 8, "train.batch_size": 3}, "batch_size"),
    ({"train.objective": "rlhf"}, "objective"),
    ({"train.objective": "gspo", "rl.group_size": 1}, "group_size"),
    ({"train.objective": "gspo", "rl.ratio_level": "seq"}, "ratio_level"),
    ({"dpo.beta": 0}, "dpo.beta"),
])
def test_objective_settings_are_checked_in_one_line(sets, words):
    with pytest.raises(ConfigError) as e:
        config(**sets)
    assert words in str(e.value) and "\n" not in str(e.value)
