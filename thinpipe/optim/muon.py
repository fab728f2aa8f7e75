"""Muon for 2-D hidden weights + AdamW for the rest (MAPL App. E.3, Table 7).

Muon (Jordan et al. 2024): momentum buffer B <- mu B + (1 - mu) G; Nesterov update
U = (1 - mu) G + mu B; orthogonalise U (here by Polar Express, as MAPL does, instead of the fixed
Newton-Schulz quintic); step W <- (1 - lr wd) W - lr sqrt(max(1, m/n)) U. This matches
``torch.optim.Muon``'s update rule (tests check it against torch with torch's own orthogonaliser);
torch's class is not used directly because it has no per-iteration coefficients.

Which parameters go where: 2-D weights inside decoder layers (attention and MLP projections) and
MAPL/SSN-free matrices use Muon; embeddings, the LM head, norms and biases use AdamW at
``adam_lr_scale`` x the Muon learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from thinpipe.optim.polar import polar_express


def muon_direction(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool,
                   orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Update ``buf`` in place and return the orthogonalised update direction (same shape as grad)."""
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    return orthogonalize(update)


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, ns_steps: int = 5,
                 orthogonalize: Callable[[torch.Tensor, int], torch.Tensor] = polar_express):
        if lr < 0 or not 0 <= momentum < 1:
            raise ValueError(f"Muon needs lr >= 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                      ns_steps=ns_steps))
        self.orthogonalize = orthogonalize

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D weights only, got shape {tuple(p.shape)}")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                d = muon_direction(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"],
                                   lambda u: self.orthogonalize(u, group["ns_steps"]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(d.to(p.dtype), alpha=-group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """2-D weights of the decoder layers (attention and MLP projections)."""
    return p.ndim == 2 and name.startswith("layers.")
