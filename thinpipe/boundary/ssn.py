"""Subspace Networks baseline (Ramasinghe et al. 2025, as described in MAPL App. A).

One fixed orthonormal basis U_k (d, k), from the QR of a seeded Gaussian matrix, shared by every
boundary and stage. The deterministic token component T_fixed (the token embedding at
initialisation, frozen) is subtracted before projection and re-added after::

    sender:    Z = (X - T_fixed[ids]) U_k          receiver:  X_hat = Z U_k^T + T_fixed[ids]

The model is confined so that X - T_fixed[ids] lies in span(U_k) exactly: the rows (output side)
of every attention output projection and MLP down projection, and the trainable part of the token
embedding (E - T_fixed), are projected onto span(U_k). **Choice**: we confine by an exact
projection after every optimizer step (and at the start), not by SSN's row-wise constant AdamW
scaling; both keep the weights in the subspace, the projection does so for any inner optimizer.
With confinement the boundary is lossless (tests/test_ssn.py). Llama models use RoPE, so there is
no additive positional term to subtract.

Grassmann refresh: every ``refresh_every`` steps, U_k moves along the horizontal part of dL/dU_k
(summed over all boundaries, averaged over DP replicas) and is re-orthonormalised
(``grassmann_step``); the weights are then re-confined to the new subspace. In a real mesh each
stage holds a copy of U_k; the refresh costs (P - 1) gradient contributions up and (P - 1) copies
down, d x k fp32 each, counted on ``pp_params``.
"""

from __future__ import annotations

import torch
from torch import nn

from thinpipe.boundary.base import Boundary, Payload
from thinpipe.boundary.mapl import id_dtype
from thinpipe.optim.stiefel import orthonormal

CONFINED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class SubspaceBasis(nn.Module):
    """The shared U_k (a buffer: no optimizer touches it; the Grassmann refresh replaces it)."""

    def __init__(self, hidden_size: int, rank: int, seed: int):
        super().__init__()
        self.register_buffer("U", orthonormal(hidden_size, rank, torch.Generator().manual_seed(seed * 7919 + 1)))


class SsnBoundary(Boundary):
    kind = "ssn"
    architectural = True

    def __init__(self, index: int, hidden_size: int, basis: SubspaceBasis, token_fixed: torch.Tensor,
                 wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, wire_dtype)
        self.basis = basis
        self.token_fixed = token_fixed  # (V, d), frozen, shared by all boundaries of a replica
        self.rank = basis.U.shape[1]

    def attach(self, sender, receiver) -> None:
        if sender.is_first:  # stage 0 owns the basis (it is checkpointed there)
            sender.boundary_modules["ssn_basis"] = self.basis

    def encode(self, x, ctx):
        z = (x - self.token_fixed[ctx.input_ids]) @ self.basis.U
        return z, Payload({"z": self._to_wire(z), "ids": ctx.input_ids.to(id_dtype(self.token_fixed.shape[0]))})

    def decode(self, payload, ctx):
        return payload.tensors["z"]

    def lift(self, z_hat, payload, ctx):
        return z_hat @ self.basis.U.T + self.token_fixed[payload.tensors["ids"].long()]

    def expected_bytes(self, tokens, element_size):
        ids = tokens * torch.empty(0, dtype=id_dtype(self.token_fixed.shape[0])).element_size()
        return tokens * self.rank * element_size + ids, tokens * self.rank * element_size


@torch.no_grad()
def confine(stages, U: torch.Tensor, token_fixed: torch.Tensor) -> None:
    """Project the confined weights of every stage onto span(U) (see the module docstring)."""
    P = U @ U.T
    for st in stages:
        for name, p in st.named_parameters():
            if name.endswith(CONFINED):
                p.copy_(P @ p)                                   # (d, in): outputs in span(U)
        if st.is_first:
            E = st.embed_tokens.weight
            E.copy_(token_fixed + (E - token_fixed) @ P)


@torch.no_grad()
def confinement_error(stages, U: torch.Tensor, token_fixed: torch.Tensor) -> float:
    """Largest relative norm of a confined weight's part outside span(U) (0 when confined)."""
    P = U @ U.T
    worst = 0.0
    for st in stages:
        for name, p in st.named_parameters():
            if name.endswith(CONFINED):
                worst = max(worst, float((p - P @ p).norm() / p.norm().clamp_min(1e-12)))
        if st.is_first:
            D = st.embed_tokens.weight - token_fixed
            worst = max(worst, float((D - D @ P).norm() / D.norm().clamp_min(1e-12)))
    return worst
