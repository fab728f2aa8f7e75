"""Collectives over a torch.distributed process group, with the in-process group's interface.

``all_reduce(rank, tensor) -> Work`` posts an asynchronous sum (the caller waits when it needs the
result, so a rank can overlap it with compute); ``all_gather`` returns every member's tensor in
group order (members may hold 1-d tensors of different lengths: gathered padded to the longest,
as tensors, never as pickled objects). Bytes are metered
with the same ring formulas as ``InProcessGroup`` so the two engines report the same totals;
``axis`` None is a control group (not metered).

A shaped group (``rate_mbps`` > 0) models a ring all-reduce over links of that rate: the
collective is posted at once, but its ``Work`` completes no earlier than post time + 2 (n-1)/n x
bytes / rate + 2 (n-1) x latency, so a caller that waits later (Streaming DiLoCo's overlap) finds
it done, and one that waits at once pays the transfer.

A GPU rank's collectives run on host copies (gloo, as the wire): ``all_reduce`` posts on a pinned
copy and its ``Work`` copies the sum back when waited on; ``all_gather`` returns host tensors moved
to the member's device. The sums are those of a CPU rank (elementwise fp32 adds in rank order).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from thinpipe.comm.header import PayloadError
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.protocols import Group, Work
from thinpipe.comm.staging import StagedWork, to_device, to_host
from thinpipe.comm.work import DONE


class _Timed(Work):
    """A Work that also waits until the modelled transfer is over."""

    def __init__(self, work: Work, ready_at: float):
        self.work, self.ready_at = work, ready_at

    def wait(self) -> None:
        self.work.wait()
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.ready_at


class DistGroup(Group):
    def __init__(self, group, size: int, meter: ByteMeter, axis: str | None, rate_mbps: float = 0.0,
                 latency_ms: float = 0.0):
        self.group, self.size, self.meter, self.axis = group, size, meter, axis
        self.rate_mbps, self.latency_ms = rate_mbps, latency_ms
        self._free_at = 0.0

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> Work:
        nbytes = 2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        if self.axis is not None:
            self.meter.add(self.axis, nbytes)
        if self.size == 1:
            return DONE
        host = to_host(tensor)
        work = self._post_sum(host)
        if host is not tensor:
            work = StagedWork(work, host, tensor)
        if not self.rate_mbps and not self.latency_ms:
            return work
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + (nbytes * 8 / (self.rate_mbps * 1e6) if self.rate_mbps else 0.0)
        return _Timed(work, self._free_at + 2 * (self.size - 1) * self.latency_ms / 1e3)

    def _post_sum(self, host: torch.Tensor) -> Work:
        """Post the sum of ``host`` over the group (the one call a managed group replaces)."""
        return dist.all_reduce(host, group=self.group, async_op=True)

    def all_gather(self, rank: int, tensor: torch.Tensor, max_numel: int | None = None
                   ) -> tuple[Work, list[torch.Tensor]]:
        """``max_numel``: the most elements a member may contribute (default: as many as this one)."""
        if self.axis is not None:
            self.meter.add(self.axis, (self.size - 1) * tensor.numel() * tensor.element_size())
        if self.size == 1:
            return DONE, [tensor.clone()]
        bound = tensor.numel() if max_numel is None else max_numel
        return DONE, [to_device(t, tensor.device) for t in gather_1d(to_host(tensor), self.size, self.group, bound)]


def gather_1d(tensor: torch.Tensor, size: int, group, max_numel: int) -> list[torch.Tensor]:
    """Every member's 1-d ``tensor`` (same dtype, any length up to ``max_numel``: a member that
    claims more is refused before anything is allocated), in group order, as tensors only."""
    flat = tensor.detach().reshape(-1)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([flat.numel()]), group=group)
    for member, n in enumerate(lengths):
        if not 0 <= int(n) <= max_numel:
            raise PayloadError(f"all-gather: member {member} of the group claims {int(n)} elements, at most "
                               f"{max_numel} are expected; refused before allocating them")
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [p[:int(n)].clone() for p, n in zip(parts, lengths)]
