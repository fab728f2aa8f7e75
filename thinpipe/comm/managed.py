"""A stage's DP group across elastic replicas: torchft's managed, reconfigurable process group.

The same interface as ``DistGroup`` (``all_reduce(rank, tensor) -> Work`` posting a sum,
``all_gather``, ``size``), so every DP scheme (``dp/``) runs on it unchanged; only who is in the
group changes. ``size`` is the number of replicas in the current quorum (torchft's
``num_participants``), and the DP algorithms divide by it: with every replica present the sums and
the divisions are those of ``--engine dist`` (the same gloo all-reduce over the same members in the
same order, replica ids sorted), so a run with no failure is bitwise that run; with a replica lost
the survivors average over themselves (docs/elastic.md).

A collective that fails (a peer died mid-way, a timeout) does not raise: torchft records the error,
the step's ``should_commit`` is False on every rank of the replica, and the engine rolls the step
back (``engine/elastic_rank.py``). Bytes are metered with ``DistGroup``'s ring formulas over the members
present.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions

from thinpipe.comm.dist_group import DistGroup
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.protocols import Work
from thinpipe.comm.staging import to_device, to_host
from thinpipe.comm.work import DONE


class ManagedGroup(DistGroup):
    def __init__(self, manager, pg, meter: ByteMeter, axis: str | None, rate_mbps: float = 0.0,
                 latency_ms: float = 0.0):
        """``manager``: this rank's ``torchft.Manager``; ``pg``: the ``torchft.ProcessGroupGloo`` it reconfigures."""
        self.manager, self.pg, self.group = manager, pg, None
        self.meter, self.axis = meter, axis
        self.rate_mbps, self.latency_ms = rate_mbps, latency_ms
        self._free_at = 0.0

    # read-only where DistGroup's is a plain attribute: nothing assigns a group's size after construction (the
    # Group protocol's ``size`` is read by the DP averages), and the quorum's size is the manager's to change
    @property
    def size(self) -> int:  # type: ignore[override]
        """Replicas in the current quorum (valid once the step's quorum is formed)."""
        return max(1, self.manager.num_participants())

    def _post_sum(self, host: torch.Tensor) -> Work:
        return self.manager.allreduce(host, reduce_op=ReduceOp.SUM)

    def all_gather(self, rank: int, tensor: torch.Tensor, max_numel: int | None = None
                   ) -> tuple[Work, list[torch.Tensor]]:
        """Every member's ``tensor`` in quorum order (members' tensors have one length here: the
        quantised DP messages of one stage); a failure leaves zeros and is reported to the manager."""
        n = self.size
        if self.axis is not None:
            self.meter.add(self.axis, (n - 1) * tensor.numel() * tensor.element_size())
        if n == 1:
            return DONE, [tensor.clone()]
        host = to_host(tensor.detach().reshape(-1)).contiguous()
        out = [torch.zeros_like(host) for _ in range(n)]
        if self.manager.errored() is None:
            try:
                work = self.pg.allgather([out], [host], AllgatherOptions())
                self.manager.wrap_future(work.get_future(), None).wait()
            except Exception as e:  # noqa: BLE001 - torchft's contract: report, skip the step, never raise
                self.manager.report_error(e)
        return DONE, [to_device(t, tensor.device) for t in out]
