"""Top-K activation sparsification at a PP boundary: the biased baseline of App. F.

Each token keeps its K = round((1-p) H) largest-magnitude dims. Unlike the PRF mask, the kept set
depends on the activation, so the indices must be sent (int16 when H < 32768). The backward is
in-graph like masking: the receiver already holds the indices, so only the K gradients return.
"""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.boundary.mask import kept_dims
from thinpipe.config.boundary_kinds import TopKKind


@implements(TopKKind)
class TopKBoundary(Boundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        return cls(index, hidden_size, cfg.p, wire_dtype)

    def __init__(self, index: int, hidden_size: int, p: float, wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, wire_dtype)
        self.p = p
        self.keep = kept_dims(hidden_size, p)
        self.index_dtype = torch.int16 if hidden_size < 2 ** 15 else torch.int32

    def encode(self, x, ctx):
        idx = x.detach().abs().topk(self.keep, dim=-1, sorted=False).indices.sort(dim=-1).values
        z = x.gather(-1, idx)
        return z, Payload({"values": self._to_wire(z), "indices": idx.to(self.index_dtype)})

    def decode(self, payload, ctx):
        return payload.tensors["values"]

    def lift(self, z_hat, payload, ctx):
        idx = payload.tensors["indices"].long()
        return z_hat.new_zeros(*z_hat.shape[:-1], self.hidden_size).scatter(-1, idx, z_hat)

    def encode_grad(self, g, ctx):
        return Payload({"values": self._to_wire(g)})

    def decode_grad(self, payload, ctx):
        return payload.tensors["values"]

    def expected_bytes(self, tokens, element_size):
        idx_size = torch.tensor([], dtype=self.index_dtype).element_size()
        return tokens * self.keep * (element_size + idx_size), tokens * self.keep * element_size
