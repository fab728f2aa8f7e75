"""Random activation masking at a PP boundary (paper §3.1, App. F).

Each token keeps exactly K = round((1-p) H) of its H hidden dims, chosen by the shared PRF keyed on
(seed, boundary, step, microbatch, replica) and the token's index in the microbatch, or, when the context gives
per-row keys (RL: a sequence's key of (step, sequence)), on (seed, boundary, row key) and the token's position,
so that a sequence draws the same masks in every forward of it; the mask itself never crosses the wire.
Masking is in-graph: the sender gathers the K kept values (``z``), the receiver scatters them back into zeros, so the
backward carries the gradients of exactly those K values and every other dim gets zero gradient.
With ``rescale`` the receiver multiplies by 1/(1-p) (App. F), which makes E_m[x_hat] = x.
"""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.boundary.prf import keep_indices, keep_indices_rows, prf_key
from thinpipe.config.boundary_kinds import MaskKind


def kept_dims(hidden_size: int, p: float) -> int:
    """K = round((1-p) H), at least 1."""
    return max(1, round((1.0 - p) * hidden_size))


@implements(MaskKind)
class MaskBoundary(Boundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        return cls(index, hidden_size, cfg.p, seed, cfg.rescale, wire_dtype, cfg.p_warmup)

    def __init__(self, index: int, hidden_size: int, p: float, seed: int, rescale: bool = True,
                 wire_dtype: torch.dtype | None = None, warmup_steps: int = 0):
        super().__init__(index, hidden_size, wire_dtype)
        self.p, self.seed, self.rescale, self.warmup_steps = p, seed, rescale, warmup_steps
        self.keep = kept_dims(hidden_size, p)
        # (1-p) is the expected kept fraction; K/H is what is actually kept per token. Scaling by
        # H/K makes the estimator exactly unbiased for the exactly-K mask (equals 1/(1-p) when
        # (1-p) H is an integer, as for the paper's settings).
        self.scale = hidden_size / self.keep

    def keep_at(self, step: int) -> int:
        """K at a step: with a warm-up (a variant, not the paper's), p ramps linearly from 0 to p.
        Both ends know the step, so K never needs to be sent."""
        if self.warmup_steps and step < self.warmup_steps:
            return kept_dims(self.hidden_size, self.p * step / self.warmup_steps)
        return self.keep

    def indices(self, ctx, tokens: int, device) -> torch.Tensor:
        # The replica joins the key so that DP replicas draw independent masks (their noise averages out).
        key = prf_key(self.seed, self.index, ctx.step, ctx.microbatch, ctx.replica)
        return keep_indices(key, tokens, self.hidden_size, self.keep_at(ctx.step), device)

    def _flat_indices(self, shape, ctx, device) -> torch.Tensor:
        if getattr(ctx, "row_keys", None) is not None:
            keys = [prf_key(self.seed, self.index, int(k)) for k in ctx.row_keys.tolist()]
            return keep_indices_rows(keys, ctx.position_ids.to(device), self.hidden_size, self.keep_at(ctx.step))
        idx = self.indices(ctx, shape[0] * shape[1], device)
        return idx.view(shape[0], shape[1], idx.shape[-1])

    def encode(self, x, ctx):
        z = x.gather(-1, self._flat_indices(x.shape, ctx, x.device))
        return z, Payload({"values": self._to_wire(z)})

    def decode(self, payload, ctx):
        return payload.tensors["values"]

    def lift(self, z_hat, payload, ctx):
        b, t, _ = z_hat.shape
        idx = self._flat_indices((b, t), ctx, z_hat.device)
        x_hat = z_hat.new_zeros(b, t, self.hidden_size).scatter(-1, idx, z_hat)
        return x_hat * (self.hidden_size / idx.shape[-1]) if self.rescale else x_hat

    def encode_grad(self, g, ctx):
        return Payload({"values": self._to_wire(g)})

    def decode_grad(self, payload, ctx):
        return payload.tensors["values"]

    def expected_bytes(self, tokens, element_size):
        n = tokens * self.keep * element_size
        return n, n
