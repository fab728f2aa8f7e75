"""What crosses the anchor links: the weight pull and the gradient push, as payload tensors.

Both engines use these functions, so the simulation's metered bytes are the bytes the real mesh
sends and the values a fast replica receives are the same bits (paper §3: the anchor pulls w_t,
pushes its gradient; App. H.1 sizes both). Everything crosses in the wire dtype (``boundary.dtype``
or the training dtype): a bf16 wire rounds the pulled weights and the pushed gradient.

A compressed push (``anchor.push_rank`` = r) sends what PowerSGD sends (the DP
compressor's code, ``dp/powersgd.py``): per compressible matrix the product P = M Q (before
orthonormalisation) and Q' = M^T P_hat, uncompressible tensors dense. The receiver rebuilds
M = orth(P) Q'^T with the same functions, so both ends agree bitwise; the error feedback stays on
the anchor side.
"""

from __future__ import annotations

import torch

from thinpipe.comm.header import Expect
from thinpipe.comm.inprocess import LocalGroup, drive_lockstep
from thinpipe.dp.powersgd import PowerSGDState, factorized, orthonormalize, powersgd_average


def _in_wire_dtype(t: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    return t.detach().to(wire_dtype) if wire_dtype is not None else t.detach()


def trained(stage) -> list[torch.Tensor]:
    """The parameters a pull carries: those that train (with LoRA the adapters only; the frozen
    base is the same seeded weights in every process and never changes)."""
    return [p for p in stage.parameters() if p.requires_grad]


def wire_expect(stage, rows_bytes: int = 0) -> Expect:
    """What an anchor link's receiver accepts (a pull's weights, a push's gradient or its PowerSGD
    factors, with their step and counters): no more than the stage's trained parameters in fp32,
    plus a few small control tensors, plus ``rows_bytes`` (the most a pull's rows of an update hold:
    ``objective/registry.py: anchor_rows_bytes``)."""
    return Expect(max_bytes=sum(p.numel() * max(4, p.element_size()) for p in trained(stage)) + CONTROL_BYTES
                  + rows_bytes)


CONTROL_BYTES = 1024  # "step", "at", "bytes", "failed": a handful of int64s


def encode_pull(params: list[torch.Tensor], wire_dtype: torch.dtype | None) -> torch.Tensor:
    """A stage's weights as one flat tensor in the wire dtype (parameter order)."""
    return torch.cat([_in_wire_dtype(p, wire_dtype).reshape(-1) for p in params])


@torch.no_grad()
def load_pull(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    expected = sum(p.numel() for p in params)
    if flat.numel() != expected:
        raise ValueError(f"a weight pull holds {flat.numel()} values, this stage has {expected}")
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()


class _Recorder(LocalGroup):
    """A one-member group that keeps what PowerSGD would all-reduce: those tensors are the push."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def all_reduce(self, rank: int, tensor: torch.Tensor):
        self.sent.append(tensor.clone())
        return super().all_reduce(rank, tensor)


@torch.no_grad()
def encode_push(grads: dict[str, torch.Tensor], state: PowerSGDState | None,
                wire_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The push's tensors for a stage's gradient ``grads`` (name -> tensor, the stage's order)."""
    if state is None:
        return {"dense": torch.cat([_in_wire_dtype(g, wire_dtype).reshape(-1) for g in grads.values()])}
    work = {n: g.clone() for n, g in grads.items()}
    rec = _Recorder()
    drive_lockstep([powersgd_average(state, work, rec, 0, 1)])
    plan = factorized({n: tuple(g.shape) for n, g in grads.items()}, state)
    dense = [work[n] for n in grads if n not in plan]
    device = next(iter(grads.values())).device
    out = {"dense": torch.cat([_in_wire_dtype(g, wire_dtype).reshape(-1) for g in dense]) if dense
           else torch.zeros(0, device=device)}
    if plan:
        # rec.sent: [dense all-reduce (if any dense), P, Q'] in powersgd_average's order
        out["p"], out["q"] = _in_wire_dtype(rec.sent[-2], wire_dtype), _in_wire_dtype(rec.sent[-1], wire_dtype)
    return out


@torch.no_grad()
def decode_push(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor],
                push_rank: int) -> dict[str, torch.Tensor]:
    """The gradient a fast replica applies, rebuilt from the push; ``like`` gives names, shapes, dtypes."""
    plan = factorized({n: tuple(t.shape) for n, t in like.items()}, PowerSGDState(rank=push_rank, start_step=0)) \
        if push_rank else {}
    out, offset, dense = {}, 0, tensors["dense"]
    expected = sum(t.numel() for n, t in like.items() if n not in plan)
    if dense.numel() != expected:
        raise ValueError(f"an anchor push holds {dense.numel()} dense values, the stage expects {expected}")
    for n, t in like.items():
        if n not in plan:
            out[n] = dense[offset:offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()
    p_off = q_off = 0
    for n, (rows, cols, r) in plan.items():
        P = tensors["p"][p_off:p_off + rows * r].view(rows, r).to(like[n].dtype, copy=True)
        Q = tensors["q"][q_off:q_off + cols * r].view(cols, r).to(like[n].dtype)
        p_off, q_off = p_off + rows * r, q_off + cols * r
        out[n] = (orthonormalize(P) @ Q.T).view(like[n].shape)
    return {n: out[n] for n in like}
