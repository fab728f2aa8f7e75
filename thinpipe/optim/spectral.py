"""Spectral-correction optimizer (paper §3.2, App. E, H.6).

Stale, unmasked anchor gradients G_anc feed a per-matrix momentum
    M <- beta M + (1 - beta) G_anc                       (on each arrival only)
whose SVD M = U S V^T is recomputed only on arrival (full, or a seeded randomized rank-r range
finder for large matrices). Each step, the masked gradient G is filtered two-sidedly in that basis
    d_i = s_i / (s_i + tau)      X = U^T G V      G_filt = U diag(d) X diag(d) V^T
and blended  G <- alpha G + (1 - alpha) G_filt  before the inner optimizer (AdamW) steps.

Choices the paper leaves open (documented in docs/anchor.md):
- ``tau`` is absolute by default (the paper writes d_i = s_i/(s_i+tau_p) with a fixed tau = 1e-3 in
  Table 2, a scale-dependent quantity); ``relative_tau`` uses tau * s_1 instead, which makes the
  filter invariant to the gradient scale.
- the momentum starts at zero and is not bias-corrected (as written); ``bias_correction`` divides
  by 1 - beta^k after k arrivals.
- only 2-D hidden matrices are filtered; vectors (norms, biases) and the token embedding / LM head
  (whose rows are vocabulary items: an anchor batch's tokens say nothing about other tokens' rows)
  pass through unchanged.
- before the first prior arrives, gradients pass through unchanged.

The math is in plain functions on tensors; ``SpectralCorrection`` only holds state and wraps an
inner ``torch.optim.Optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpectralBasis:
    U: torch.Tensor  # (m, r) left singular vectors of the anchor momentum
    S: torch.Tensor  # (r,)   singular values, descending
    V: torch.Tensor  # (n, r) right singular vectors


def randomized_svd(M: torch.Tensor, rank: int, generator: torch.Generator, power_iters: int = 2) -> SpectralBasis:
    """Rank-r SVD by a seeded randomized range finder (Halko et al. 2011) with power iterations."""
    m, n = M.shape
    q = min(rank + 8, m, n)  # oversampling
    omega = torch.randn(n, q, generator=generator, dtype=M.dtype).to(M.device)  # CPU draw: equal on every device
    Y = M @ omega
    Q = torch.linalg.qr(Y).Q
    for _ in range(power_iters):
        Q = torch.linalg.qr(M.T @ Q).Q
        Q = torch.linalg.qr(M @ Q).Q
    Ub, S, Vh = torch.linalg.svd(Q.T @ M, full_matrices=False)
    return SpectralBasis((Q @ Ub)[:, :rank], S[:rank], Vh[:rank].T)


def anchor_basis(M: torch.Tensor, rank: int, generator: torch.Generator) -> SpectralBasis:
    """Full thin SVD when rank covers the matrix, else randomized rank-r."""
    if rank <= 0 or rank >= min(M.shape):
        U, S, Vh = torch.linalg.svd(M, full_matrices=False)
        return SpectralBasis(U, S, Vh.T)
    return randomized_svd(M, rank, generator)


def filter_weights(S: torch.Tensor, tau: float, relative: bool = False) -> torch.Tensor:
    """d_i = s_i / (s_i + tau), or with tau relative to the top singular value s_1."""
    t = tau * S[0] if relative and S.numel() else tau
    return S / (S + t)


def spectral_filter(G: torch.Tensor, basis: SpectralBasis, d: torch.Tensor) -> torch.Tensor:
    """Two-sided filter: U diag(d) (U^T G V) diag(d) V^T."""
    X = basis.U.T @ G @ basis.V
    X = d[:, None] * X * d[None, :]
    return basis.U @ X @ basis.V.T


def blend(G: torch.Tensor, G_filt: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha G_mask + (1 - alpha) G_filt."""
    return alpha * G + (1.0 - alpha) * G_filt


def is_filtered(name: str, p: torch.Tensor) -> bool:
    """Policy: 2-D hidden matrices only (see module docstring)."""
    return p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name


class SpectralCorrection:
    """Wraps an inner optimizer; call ``receive_prior`` when an anchor gradient arrives, ``step`` each step."""

    def __init__(self, named_params, inner: torch.optim.Optimizer, tau: float = 1e-3, alpha: float = 0.3,
                 beta: float = 0.9, rank: int = 64, relative_tau: bool = False, bias_correction: bool = False,
                 seed: int = 0):
        self.inner = inner
        self.tau, self.alpha, self.beta, self.rank = tau, alpha, beta, rank
        self.relative_tau, self.bias_correction, self.seed = relative_tau, bias_correction, seed
        self.params = {n: p for n, p in named_params if is_filtered(n, p)}
        self.momentum: dict[str, torch.Tensor] = {}
        self.basis: dict[str, SpectralBasis] = {}
        self.priors_received = 0

    @property
    def param_groups(self):
        return self.inner.param_groups

    def receive_prior(self, grads: dict[str, torch.Tensor]) -> None:
        """Fold one (stale) anchor gradient into the momentum and refresh each matrix's basis."""
        self.priors_received += 1
        k = self.priors_received
        for i, (name, p) in enumerate(self.params.items()):
            g = grads.get(name)
            if g is None:
                continue
            M = self.momentum.get(name)
            g = g.detach().to(p.device, p.dtype)
            M = (1 - self.beta) * g if M is None else self.beta * M + (1 - self.beta) * g
            self.momentum[name] = M
            M_eff = M / (1 - self.beta ** k) if self.bias_correction else M
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + k * 7919 + i)
            self.basis[name] = anchor_basis(M_eff, self.rank, gen)

    @torch.no_grad()
    def apply(self) -> None:
        """Replace each filtered parameter's gradient by the blend (no-op before the first prior).
        At alpha = 1 the blend is 1 * G + 0 * G_filt = G exactly, so no special case is needed."""
        if not self.basis:
            return
        for name, p in self.params.items():
            basis = self.basis.get(name)
            if basis is None or p.grad is None:
                continue
            d = filter_weights(basis.S, self.tau, self.relative_tau)
            g = p.grad
            X = basis.U.T @ g @ basis.V
            X = d[:, None] * X * d[None, :]
            # blend(g, spectral_filter(g)) fused in place: g <- alpha g + (1 - alpha) (U X) V^T
            g.mul_(self.alpha).addmm_(basis.U @ X, basis.V.T, alpha=1.0 - self.alpha)

    def step(self) -> None:
        self.apply()
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def count_above_tau(self) -> dict[str, int]:
        """Per matrix: how many singular values of the anchor momentum exceed tau (diagnostic)."""
        out = {}
        for name, b in self.basis.items():
            thr = self.tau * float(b.S[0]) if self.relative_tau else self.tau
            out[name] = int((b.S > thr).sum())
        return out

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "priors_received": self.priors_received,
                "momentum": dict(self.momentum),
                "basis": {n: (b.U, b.S, b.V) for n, b in self.basis.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.priors_received = state["priors_received"]
        # on each parameter's device (a checkpoint loads on the CPU)
        self.momentum = {n: t.to(self.params[n].device) for n, t in state["momentum"].items()}
        self.basis = {n: SpectralBasis(*(x.to(self.params[n].device) for x in t)) for n, t in state["basis"].items()}
