"""Autograd plumbing of a boundary, written once for every compressor and both transports.

The four calls below are what a stage executor does at a boundary; the transport (in-process
mailbox or torch.distributed) only moves the payloads between them. Because the receiver works on
a leaf ``z_hat`` and the sender resumes autograd from ``z``, the two halves can live in different
processes; in one process they give exactly the gradients of the unsplit graph.
"""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Boundary, Payload


def sender_forward(boundary: Boundary, x: torch.Tensor, ctx) -> tuple[torch.Tensor, Payload]:
    """Sender: returns (z to keep for the backward, payload to send)."""
    return boundary.encode(x, ctx)


def receiver_forward(boundary: Boundary, payload: Payload, ctx,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Receiver: returns (z_hat leaf whose .grad is sent back, x_hat to feed the stage)."""
    z_hat = boundary.decode(payload, ctx)
    if z_hat.is_floating_point():
        # A fresh leaf (never the payload tensor itself), in the compute dtype.
        z_hat = z_hat.detach().to(dtype).requires_grad_(True)
    return z_hat, boundary.lift(z_hat, payload, ctx)


def receiver_backward(boundary: Boundary, z_hat: torch.Tensor, ctx) -> Payload:
    """Receiver, after its stage's backward: the gradient payload to send upstream."""
    if z_hat.grad is None:
        raise RuntimeError(f"boundary {boundary.index}: the receiving stage produced no gradient for its input")
    return boundary.encode_grad(z_hat.grad, ctx)


def sender_backward(boundary: Boundary, z: torch.Tensor, payload: Payload, ctx) -> None:
    """Sender: continue the backward from z with the decoded gradient."""
    g = boundary.decode_grad(payload, ctx)
    torch.autograd.backward(z, g.to(z.dtype) if g.dtype != z.dtype else g)


@torch.no_grad()
def through(boundary: Boundary, x: torch.Tensor, ctx) -> torch.Tensor:
    """Both ends in one process, no gradient: what the receiver feeds its stage (evaluation through
    a boundary that is part of the model)."""
    _, payload = sender_forward(boundary, x, ctx)
    return receiver_forward(boundary, payload, ctx, torch.float32)[1]
