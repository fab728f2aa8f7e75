"""A stage's executor: runs its F/B actions, talking to neighbours only through a transport.

The same worker serves the single-process simulation (in-process mailbox) and real processes
(torch.distributed send/recv): only ``transport`` differs.
"""

from __future__ import annotations

import torch

from thinpipe.boundary import Boundary
from thinpipe.boundary.link import receiver_backward, receiver_forward, sender_backward, sender_forward
from thinpipe.comm.protocols import Transport
from thinpipe.comm.tags import Activation, Gradient
from thinpipe.models.stages import Stage
from thinpipe.placement import autocast, device_of
from thinpipe.rank.timing import StepTimes


class StageWorker:
    def __init__(self, stage: Stage, replica: int, in_boundary: Boundary | None, out_boundary: Boundary | None,
                 transport: Transport, compute_dtype: torch.dtype = torch.float32,
                 axes: tuple[str | None, str | None] = ("pp_fwd", "pp_bwd")):
        self.stage, self.replica = stage, replica
        self.in_boundary, self.out_boundary = in_boundary, out_boundary
        self.transport, self.compute_dtype = transport, compute_dtype
        # the anchor circuit meters its PP traffic on its own axis; None: unmetered (evaluation, the reference)
        self.fwd_axis, self.bwd_axis = axes
        self._saved: dict[int, dict] = {}
        self.losses: list[float] = []
        self.times = StepTimes()  # where this step's time goes (rank/timing.py)

    @property
    def _receiving(self) -> Boundary:
        """The boundary this stage receives through (every stage but the first has one)."""
        assert self.in_boundary is not None
        return self.in_boundary

    @property
    def _sending(self) -> Boundary:
        """The boundary this stage sends through (every stage but the last has one)."""
        assert self.out_boundary is not None
        return self.out_boundary

    def _autocast(self):
        return autocast(device_of(self.stage), self.compute_dtype)

    def forward(self, ctx) -> None:
        saved = self._saved.setdefault(ctx.microbatch, {})
        if self.stage.is_first:
            x = ctx.input_ids
        else:
            with self.times.waiting("prev"):
                payload = self.transport.recv(Activation(self.replica, self._receiving.index, ctx.microbatch),
                                              self._receiving.payload_expect("fwd", ctx.tokens, ctx))
        with self.times.compute():
            if not self.stage.is_first:
                saved["z_hat"], x = receiver_forward(self._receiving, payload, ctx, torch.float32)
            with self._autocast():
                out = self.stage(x, ctx)
            if self.stage.is_last:
                saved["loss"] = out
                self.losses.append(float(out.detach()))
            else:
                saved["z"], payload = sender_forward(self._sending, out, ctx)
        if not self.stage.is_last:
            self.transport.send(Activation(self.replica, self._sending.index, ctx.microbatch), payload,
                                self.fwd_axis)

    def clear_saved(self) -> None:
        """Forget what forwards kept for their backwards (after forward-only passes)."""
        self._saved.clear()

    def backward(self, ctx) -> None:
        saved = self._saved.pop(ctx.microbatch)
        if not self.stage.is_last:
            with self.times.waiting("next"):
                payload = self.transport.recv(Gradient(self.replica, self._sending.index, ctx.microbatch),
                                              self._sending.payload_expect("bwd", ctx.tokens, ctx))
        with self.times.compute():
            if self.stage.is_last:
                saved["loss"].backward()
            else:
                sender_backward(self._sending, saved["z"], payload, ctx)
            if not self.stage.is_first:
                payload = receiver_backward(self._receiving, saved["z_hat"], ctx)
        if not self.stage.is_first:
            self.transport.send(Gradient(self.replica, self._receiving.index, ctx.microbatch), payload, self.bwd_axis)
