"""Projector updates on the Stiefel and Grassmann manifolds.

SPEL (spectral steepest descent on the Stiefel manifold; MAPL §3.3, Algorithm 1, App. C), for a
projector A in St(d, r) = {A : A^T A = I_r} with Euclidean gradient g:
    g_R = g - A sym(A^T g)                 tangent projection           (eq. 4)
    m   = beta m + (1 - beta) g_R          heavy-ball momentum          (eq. 5)
    D   = PolarExpress(m)                  spectral-norm LMO direction  (eq. 6, 5 steps)
    A  <- PolarExpress(A - lr D)           retraction onto St(d, r)     (eq. 7, 7 steps)

Grassmann refresh (Subspace Networks' basis update, MAPL App. A): the subspace span(U) moves along
the horizontal gradient (I - U U^T) g and is re-orthonormalised by QR (sign-fixed so that a zero
step returns U exactly).

The math is plain functions; ``SPEL`` is a thin ``torch.optim.Optimizer`` holding the momentum.
"""

from __future__ import annotations

import torch

from thinpipe.optim.polar import polar_express


def sym(M: torch.Tensor) -> torch.Tensor:
    return 0.5 * (M + M.T)


def tangent_projection(A: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Projection of g onto the tangent space of St(d, r) at A: A^T g_R is skew-symmetric."""
    return g - A @ sym(A.T @ g)


def spel_step(A: torch.Tensor, g: torch.Tensor, momentum: torch.Tensor, lr: float, beta: float,
              lmo_steps: int = 5, retraction_steps: int = 7) -> torch.Tensor:
    """One SPEL update. ``momentum`` (d, r) is updated in place; returns the new A (d, r)."""
    momentum.mul_(beta).add_(tangent_projection(A, g), alpha=1.0 - beta)
    direction = polar_express(momentum, lmo_steps)
    return polar_express(A - lr * direction, retraction_steps)


def stiefel_error(A: torch.Tensor) -> float:
    """||A^T A - I||_F: how far A is from St(d, r)."""
    eye = torch.eye(A.shape[1], dtype=A.dtype, device=A.device)
    return float((A.T @ A - eye).norm())


def orthonormal(d: int, r: int, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """A seeded random point of St(d, r): Q of the QR of a Gaussian matrix, signs fixed."""
    Q, R = torch.linalg.qr(torch.randn(d, r, generator=generator, dtype=torch.float64))
    return (Q * torch.sign(torch.diagonal(R))).to(dtype)


def grassmann_step(U: torch.Tensor, g: torch.Tensor, lr: float) -> torch.Tensor:
    """Move span(U) against the horizontal gradient and re-orthonormalise (QR retraction)."""
    Q, R = torch.linalg.qr(U - lr * (g - U @ (U.T @ g)))
    return Q * torch.sign(torch.diagonal(R))


class SPEL(torch.optim.Optimizer):
    """SPEL over projector parameters (each a (d, r) matrix on St(d, r)).

    Parameter-group keys: ``lr``, ``beta`` (momentum), ``lmo_steps``, ``retraction_steps``."""

    def __init__(self, params, lr: float, beta: float = 0.9, lmo_steps: int = 5, retraction_steps: int = 7):
        if lr < 0 or not 0 <= beta < 1:
            raise ValueError(f"SPEL needs lr >= 0 and 0 <= beta < 1, got lr={lr}, beta={beta}")
        super().__init__(params, dict(lr=lr, beta=beta, lmo_steps=lmo_steps, retraction_steps=retraction_steps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for A in group["params"]:
                if A.grad is None:
                    continue
                if A.ndim != 2 or A.shape[0] < A.shape[1]:
                    raise ValueError(f"SPEL parameters must be tall (d, r) matrices, got {tuple(A.shape)}")
                state = self.state[A]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(A)
                A.copy_(spel_step(A, A.grad, state["momentum"], group["lr"], group["beta"],
                                  group["lmo_steps"], group["retraction_steps"]))
