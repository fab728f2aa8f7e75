"""The PP boundary protocol (DESIGN.md property 3), written once for every compressor.

A boundary sits between stage s (sender) and stage s+1 (receiver)::

    forward   sender:   z, payload = encode(x, ctx)      z: differentiable, in the sender's graph
              wire:     payload                           explicit tensors; their bytes are counted
              receiver: z_hat = decode(payload, ctx)      plain tensor, made a leaf by the plumbing
                        x_hat = lift(z_hat, payload, ctx) differentiable in z_hat (and receiver params)
    backward  receiver: payload = encode_grad(dL/dz_hat, ctx)
              sender:   dL/dz = decode_grad(payload, ctx); autograd continues from z

``z`` is the quantity whose gradient crosses back: for masking the K kept values (so the backward
carries exactly their K gradients), for a dense boundary the activation itself. In-graph
compressors put their structure in encode/lift; off-graph ones (quantisers) in the payload
packing. Nothing else in the library touches the wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Payload:
    """What crosses a link: named tensors. Its size on the wire is the sum of their bytes."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()}


class Boundary(nn.Module):
    """Base class: the dense (identity) boundary. Subclasses override what they compress."""

    kind = "identity"
    architectural = False  # True: part of the model (evaluation runs through it); False: a wire codec

    def __init__(self, index: int, hidden_size: int, wire_dtype: torch.dtype | None = None):
        super().__init__()
        self.index, self.hidden_size, self.wire_dtype = index, hidden_size, wire_dtype

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t if self.wire_dtype is None or t.dtype == self.wire_dtype else t.to(self.wire_dtype)

    # sender -------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, Payload]:
        return x, Payload({"x": self._to_wire(x)})

    def decode_grad(self, payload: Payload, ctx) -> torch.Tensor:
        return payload.tensors["g"]

    # receiver -----------------------------------------------------------------------------------
    def decode(self, payload: Payload, ctx) -> torch.Tensor:
        return payload.tensors["x"]

    def lift(self, z_hat: torch.Tensor, payload: Payload, ctx) -> torch.Tensor:
        return z_hat

    def encode_grad(self, g: torch.Tensor, ctx) -> Payload:
        return Payload({"g": self._to_wire(g)})

    # boundary parameters (DESIGN.md property 3): none here -------------------------------------
    has_shared_params = False  # True: one end owns parameters the other end computes with (synced per step)

    def attach(self, sender, receiver) -> None:
        """Register the boundary's owned modules on the stages that own them."""

    def receiver_param_grads(self) -> Payload | None:
        """Receiver -> owner after the backward: gradient contributions to shared parameters."""
        return None

    def owner_absorb_grads(self, payload: Payload) -> None:
        raise NotImplementedError

    def owner_params(self) -> Payload | None:
        """Owner -> receiver after the optimizer step: the new shared parameters."""
        return None

    def receiver_load_params(self, payload: Payload) -> None:
        raise NotImplementedError

    # accounting ---------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """State the boundary keeps beyond parameters (AQ-SGD's per-example buffers), both ends."""
        return 0

    def expected_param_bytes(self) -> int:
        """Parameter-sync bytes per optimizer step."""
        return 0

    def expected_bytes(self, tokens: int, element_size: int) -> tuple[int, int]:
        """(forward, backward) payload bytes for ``tokens`` tokens: the formula tests check against."""
        n = tokens * self.hidden_size * element_size
        return n, n
