"""Exact data parallelism: average gradients over a stage's DP group every step.

Split into ``start`` (post the collective, get a handle) and ``finish`` (wait, write back) so that a
caller can overlap the wait with other work and so that one process can drive several virtual
ranks (the simulation posts for every replica before finishing any). Compressed schemes (PowerSGD,
DiLoCo, Streaming DiLoCo) implement the same two calls.
"""

from __future__ import annotations

import torch


class AllReduceDP:
    def __init__(self, group):
        self.group = group

    def start(self, rank: int, params: list[torch.nn.Parameter]):
        grads = [p.grad for p in params if p.grad is not None]
        if self.group.size == 1 or not grads:
            return None
        flat = torch.cat([g.reshape(-1) for g in grads])
        return grads, flat, self.group.all_reduce(rank, flat)

    def finish(self, handle) -> None:
        if handle is None:
            return
        grads, flat, work = handle
        work.wait()
        flat /= self.group.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
