"""The measurements behind MAPL's Figures 3-5, as plain functions of tensors.

- ``cumulative_energy``: E(r) = sum_{i<=r} s_i^2 / sum_i s_i^2 of the residual X - E[ids] (Fig. 3b)
- ``principal_angle_deg``: mean over k of arccos(s_k(A_i^T A_j)) in degrees (Fig. 4a)
- ``captured_energy``: ||X A||_F^2 / ||X||_F^2 (Fig. 4b)
- ``cosine_preservation``: cos(x_i A, x_j A) against cos(x_i, x_j) on random token pairs, and their
  Pearson correlation (Fig. 4c)
- ``stable_rank``: ||W||_F^2 / ||W||_2^2 (App. D, Fig. 5)
"""

from __future__ import annotations

import math

import torch

from thinpipe.optim.stiefel import orthonormal


def singular_values(X: torch.Tensor) -> torch.Tensor:
    """Singular values of a (tokens, d) matrix, descending (float64 for the small tail)."""
    return torch.linalg.svdvals(X.double())


def cumulative_energy(s: torch.Tensor) -> torch.Tensor:
    e = s.double().pow(2)
    return torch.cumsum(e, 0) / e.sum()


def rank_for_energy(s: torch.Tensor, fraction: float) -> int:
    """Smallest r with E(r) >= fraction."""
    return int((cumulative_energy(s) < fraction).sum()) + 1


def principal_angle_deg(A: torch.Tensor, B: torch.Tensor) -> float:
    """Mean principal angle between span(A) and span(B) (orthonormal columns), in degrees."""
    s = torch.linalg.svdvals(A.double().T @ B.double()).clamp(-1.0, 1.0)
    return float(torch.rad2deg(torch.arccos(s)).mean())


def captured_energy(X: torch.Tensor, A: torch.Tensor) -> float:
    return float((X.double() @ A.to(X.device, torch.float64)).pow(2).sum() / X.double().pow(2).sum())


def cosine_preservation(X: torch.Tensor, A: torch.Tensor, pairs: int = 2000, seed: int = 0):
    """(cos in R^d, cos after projection, Pearson correlation) over random token pairs."""
    g = torch.Generator().manual_seed(seed)
    i = torch.randint(0, X.shape[0], (pairs,), generator=g)
    j = torch.randint(0, X.shape[0], (pairs,), generator=g)
    keep = i != j
    i, j = i[keep].to(X.device), j[keep].to(X.device)  # drawn on the CPU: the same pairs on every device
    Xd = X.double()
    full = torch.nn.functional.cosine_similarity(Xd[i], Xd[j], dim=-1)
    P = Xd @ A.to(X.device, torch.float64)
    proj = torch.nn.functional.cosine_similarity(P[i], P[j], dim=-1)
    r = float(torch.corrcoef(torch.stack([full, proj]))[0, 1])
    return full, proj, (r if math.isfinite(r) else float("nan"))


def stable_rank(W: torch.Tensor) -> float:
    W = W.detach().double()
    return float(W.pow(2).sum() / torch.linalg.matrix_norm(W, ord=2).pow(2))


def energy_vs_fixed(X: torch.Tensor, A: torch.Tensor, seed: int, index: int) -> tuple[float, float]:
    """(captured energy of ``X`` by ``A``, by a fixed random orthonormal basis of the same rank),
    MAPL Fig. 4b; the fixed basis of boundary ``index`` is seeded so every run draws the same one."""
    fixed = orthonormal(A.shape[0], A.shape[1], torch.Generator().manual_seed(seed + 17 + index))
    return captured_energy(X, A), captured_energy(X, fixed)
