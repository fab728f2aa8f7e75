"""Exact data parallelism: average tensors over a DP group (``allreduce_average``), and the scheme that
averages the gradients with it every step (``AllReduce``).

A generator yielding the collective's ``Work`` (the same shape as PowerSGD and DiLoCo), so that one
process can drive several simulated ranks in lockstep and a real rank can overlap the wait.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from thinpipe.comm.protocols import Group
from thinpipe.dp.kinds import AllReduceKind
from thinpipe.dp.scheme import DPScheme


def allreduce_average(tensors: dict[str, torch.Tensor], group: Group, rank: int, world: int) -> Generator:
    """Replace each tensor (in place) by its mean over the group."""
    if not tensors:
        return
    ts = list(tensors.values())
    flat = torch.cat([t.reshape(-1) for t in ts])
    yield group.all_reduce(rank, flat)
    flat /= world
    offset = 0
    for t in ts:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class AllReduce(AllReduceKind, DPScheme):
    """``dp.kind = allreduce``: the exact gradient average, every step."""

    def sync_grads(self, step: int, grads: dict[str, torch.Tensor]) -> Generator:
        if self.group.size > 1:
            yield from allreduce_average(grads, self.group, self.member, self.group.size)
