"""What crosses a link: named tensors (docs/architecture.md: one payload's path). Every transport and
codec speaks it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Payload:
    """What crosses a link: named tensors. Its size on the wire is the sum of their bytes."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()}
