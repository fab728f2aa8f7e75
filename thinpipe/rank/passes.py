"""Passes through replica 0's pipeline over any transport: residuals at the boundaries (and the
residual start of learned boundaries), the held-out loss.

The residual at boundary b is the sender's activation minus the token-deterministic part the
boundary does not send (``Boundary.residual_offset``; the token embedding for kinds without one),
MAPL Fig. 3's X - E[ids]. Replica 0's stages run the batches through the pipeline as it trains
(through architectural boundaries, dense otherwise), one rank per stage, each batch one round: the
simulation drives every rank's generator in lockstep over its mailbox, a real rank runs its own
over the evaluation transport; the arithmetic is the same.

The residual start (``Boundary.wants_residual_init``; MAPL's PCA start, §3.2): boundary by
boundary, since a start changes what the later boundaries see, the sender computes the start from
its residuals and every copy of the boundary loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from thinpipe.boundary import Boundary
from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.comm.protocols import Transport
from thinpipe.comm.tags import EvalActivation
from thinpipe.comm.work import DONE
from thinpipe.placement import autocast, device_of, to_device
from thinpipe.rank.context import make_contexts


def eval_boundary(b: Boundary) -> Boundary:
    """What evaluation passes through: the boundary itself when it is part of the model, else dense."""
    return b if b.architectural else Boundary(b.index, b.hidden_size, None)


@torch.no_grad()
def residual_pass(stage, in_b: Boundary | None, out_b: Boundary | None, transport: Transport, batches: list[dict],
                  at: set[int], step: int, out: dict[int, list[torch.Tensor]],
                  embed: Callable | None = None) -> Generator:
    """Replica 0's rank of ``stage``: appends to ``out[b]`` its (tokens, d) residuals at each of its
    boundaries b in ``at``; ranks past the last boundary of ``at`` take no part."""
    s, last = stage.index, max(at)
    if s > last:
        return
    assert out_b is not None  # s <= a boundary's index: this stage sends through boundary s
    for i, batch in enumerate(batches):
        ctx = make_contexts(to_device(batch, device_of(stage)), 1, step, 0)[0]
        key = ("residuals", last, i)
        if s == 0:
            x = ctx.input_ids
        else:
            assert in_b is not None  # every stage but the first receives through one
            b = eval_boundary(in_b)
            expect = b.payload_expect("fwd", ctx.tokens, ctx)
            x = receiver_forward(b, transport.recv(EvalActivation(0, s - 1, key), expect),
                                 ctx, torch.float32)[1]
        x = stage(x, ctx)
        if s in at:
            off = out_b.residual_offset(ctx.input_ids)
            if off is None:
                if embed is None:
                    raise ValueError(f"boundary {s} ({out_b.kind}) has no residual offset of its own and this rank "
                                     "holds no token embedding")
                off = embed(ctx.input_ids)
            out.setdefault(s, []).append((x - off).reshape(-1, x.shape[-1]).float())
        if s < last:
            transport.send(EvalActivation(0, s, key), sender_forward(eval_boundary(out_b), x, ctx)[1], None)
        yield DONE
    transport.flush()


def residual_start_boundaries(bounds: list[Boundary]) -> list[int]:
    """The boundaries that want a residual start, in pipeline order."""
    return [b.index for b in bounds if b.wants_residual_init]


def start_copies(dp: int) -> int:
    """Copies a residual start's payload reaches beyond the owner's: both ends of the boundary on every
    replica but the owner's own end (``pp_params`` bytes = payload bytes x this)."""
    return 2 * dp - 1


@torch.no_grad()
def heldout_pass(stage, in_b: Boundary | None, out_b: Boundary | None, transport: Transport, batches: list[dict],
                 compute_dtype: torch.dtype, step: int, out: list[tuple[float, int]], replica: int = 0) -> Generator:
    """The held-out loss, written once for both engines: ``replica``'s rank of ``stage`` runs
    ``batches`` through the pipeline (dense boundaries unless the boundary is part of the model),
    one batch per round; the last stage appends (sum of token losses, token count) per batch to
    ``out``. The simulation drives every rank of the replica in lockstep over its mailbox
    (``SimMesh.eval_loss``), a real rank runs its own over the evaluation transport."""
    for i, batch in enumerate(batches):
        batch = to_device(batch, device_of(stage))
        ctx = make_contexts(batch, 1, step, replica)[0]
        ctx.loss_scale = 1.0
        if stage.is_first:
            x = ctx.input_ids
        else:
            assert in_b is not None  # every stage but the first receives through one
            b = eval_boundary(in_b)
            x = receiver_forward(b, transport.recv(EvalActivation(replica, stage.index - 1, ("val", i)),
                                                   b.payload_expect("fwd", ctx.tokens, ctx)), ctx, torch.float32)[1]
        with autocast(device_of(stage), compute_dtype):
            x = stage(x, ctx)
        if stage.is_last:
            out.append((float(x), int((batch["labels"][:, 1:] != -100).sum())))
        else:
            assert out_b is not None  # every stage but the last sends through one
            transport.send(EvalActivation(replica, stage.index, ("val", i)),
                           sender_forward(eval_boundary(out_b), x, ctx)[1], None)
        yield DONE
    transport.flush()
