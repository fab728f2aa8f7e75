"""Collectives over a torch.distributed process group, with the in-process group's interface.

``all_reduce(rank, tensor) -> Work`` posts an asynchronous sum (the caller waits when it needs the
result, so a rank can overlap it with compute); ``all_gather`` returns every member's tensor in
group order (members may hold tensors of different sizes: gathered as objects). Bytes are metered
with the same ring formulas as ``InProcessGroup`` so the two engines report the same totals;
``axis`` None is a control group (not metered).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thinpipe.comm.meter import ByteMeter


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class DistGroup:
    def __init__(self, group, size: int, meter: ByteMeter, axis: str | None):
        self.group, self.size, self.meter, self.axis = group, size, meter, axis

    def all_reduce(self, rank: int, tensor: torch.Tensor):
        if self.axis is not None:
            self.meter.add(self.axis, 2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size)
        if self.size == 1:
            return _Done()
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, rank: int, tensor: torch.Tensor):
        if self.axis is not None:
            self.meter.add(self.axis, (self.size - 1) * tensor.numel() * tensor.element_size())
        if self.size == 1:
            return _Done(), [tensor.clone()]
        out: list = [None] * self.size
        dist.all_gather_object(out, tensor.detach().cpu(), group=self.group)
        return _Done(), out
