"""Bottleneck projection: a learned linear down/up pair at a PP boundary (anchor-priors Table 4,
"Bottleneck Proj.", 20x).

    sender:    z = x W_down^T       (B, T, K)   W_down (K, H), a parameter of the sender stage
    receiver:  x_hat = z W_up^T     (B, T, H)   W_up (H, K), a parameter of the receiver stage
    backward:  dL/dz (K values per token) crosses back

K = round((1 - p) H), the same K as masking and top-K at ``boundary.p`` (p = 0.95: 20x). Each half
is an ordinary parameter of the stage that uses it, so nothing but z and its gradient crosses (no
parameter sync, unlike MAPL's shared projector). Both start from one seeded orthonormal A (H, K):
W_down = A^T, W_up = A, an orthogonal projection onto a random K-dim subspace, and then learn freely
(no manifold constraint: that is the difference from MAPL). The pair is part of the model
(``architectural``): evaluation runs through it and ``export`` refuses it.
"""

from __future__ import annotations

import torch
from torch import nn

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.boundary.mask import kept_dims
from thinpipe.config.boundary_kinds import BottleneckKind
from thinpipe.optim.stiefel import orthonormal


@implements(BottleneckKind)
class BottleneckBoundary(Boundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        return cls(index, hidden_size, cfg.p, seed, wire_dtype)

    def __init__(self, index: int, hidden_size: int, p: float, seed: int, wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, wire_dtype)
        self.keep = kept_dims(hidden_size, p)
        A = orthonormal(hidden_size, self.keep, torch.Generator().manual_seed(seed * 7919 + index))
        self.down = nn.Linear(hidden_size, self.keep, bias=False)
        self.up = nn.Linear(self.keep, hidden_size, bias=False)
        with torch.no_grad():
            self.down.weight.copy_(A.T)
            self.up.weight.copy_(A)

    def attach(self, sender, receiver) -> None:
        sender.boundary_modules["out_down"] = self.down
        receiver.boundary_modules["in_up"] = self.up

    def encode(self, x, ctx):
        z = self.down(x)
        return z, Payload({"z": self._to_wire(z)})

    def decode(self, payload, ctx):
        return payload.tensors["z"]

    def lift(self, z_hat, payload, ctx):
        return self.up(z_hat.to(self.up.weight.dtype))

    def expected_bytes(self, tokens, element_size):
        n = tokens * self.keep * element_size
        return n, n
