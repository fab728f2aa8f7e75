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
With confinement the boundary is lossless (tests/unit/boundary/test_ssn.py). Llama models use RoPE, so there is
no additive positional term to subtract.

Grassmann refresh: every ``refresh_every`` steps, U_k moves along the horizontal part of dL/dU_k
(summed over all boundaries, averaged over DP replicas) and is re-orthonormalised
(``grassmann_step``); the weights are then re-confined to the new subspace. Each stage holds a
copy of U_k (``SubspaceBasis`` is the boundary contract's ``StageState``): on a refresh step every
use of U_k (a boundary's sender or receiver end) computes with its own leaf, so each stage knows
its own part of dL/dU_k; the parts are summed up the pipeline, (P - 1) messages, and the new basis
comes back down, (P - 1) messages, d x k fp32 each, counted on ``pp_params`` by the transport.
"""

from __future__ import annotations

import torch
from torch import nn

from thinpipe.boundary.base import Boundary, Payload, StageState, implements
from thinpipe.boundary.mapl import id_dtype
from thinpipe.config.boundary_kinds import SsnKind
from thinpipe.optim.stiefel import grassmann_step, orthonormal

CONFINED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class SubspaceBasis(nn.Module, StageState):
    """The shared U_k (a buffer: no optimizer touches it; the Grassmann refresh replaces it) and the
    weights' confinement to it, as the contract's stage state."""

    U: torch.Tensor  # the buffers (registered in __init__), typed for the checker
    token_fixed: torch.Tensor

    def __init__(self, hidden_size: int, rank: int, seed: int, token_fixed: torch.Tensor, refresh_every: int = 0,
                 refresh_lr: float = 0.0):
        super().__init__()
        self.register_buffer("U", orthonormal(hidden_size, rank, torch.Generator().manual_seed(seed * 7919 + 1)))
        # a buffer (moves with the module to the rank's device), not part of a checkpoint: it is the
        # frozen token embedding every process derives from the model
        self.register_buffer("token_fixed", token_fixed, persistent=False)
        self.refresh_every, self.refresh_lr = refresh_every, refresh_lr
        self._leaves: dict[tuple[str, int], torch.Tensor] | None = None  # armed: one leaf per use

    def use(self, end: str, index: int) -> torch.Tensor:
        """U_k as boundary ``index``'s ``end`` ("send" / "recv") computes with it."""
        if self._leaves is None:
            return self.U
        return self._leaves.setdefault((end, index), self.U.detach().clone().requires_grad_(True))

    # StageState ---------------------------------------------------------------------------------
    def refresh_due(self, step: int) -> bool:
        return self.refresh_every > 0 and (step + 1) % self.refresh_every == 0

    def before_step(self, step: int) -> None:
        if self.refresh_due(step) and self._leaves is None:
            self._leaves = {}

    def after_step(self, stage) -> None:
        confine([stage], self.U, self.token_fixed)

    def contribution(self, in_boundary, out_boundary) -> Payload:
        g = torch.zeros_like(self.U)
        keys = ([("send", out_boundary.index)] if out_boundary is not None else []) + \
               ([("recv", in_boundary.index)] if in_boundary is not None else [])
        for key in keys:
            leaf = (self._leaves or {}).get(key)
            if leaf is not None and leaf.grad is not None:
                g = g + leaf.grad
        return Payload({"U": g})

    def update(self, total: Payload) -> Payload:
        with torch.no_grad():
            return Payload({"U": grassmann_step(self.U.detach(), total.tensors["U"], self.refresh_lr)})

    # StageState's name for the refresh's last phase shadows nn.Module.apply(fn) (nothing applies a function
    # over modules holding the basis; renaming the contract's method would change every stage state plug-in)
    def apply(self, payload: Payload, stage) -> None:  # type: ignore[override]
        self._leaves = None
        self.U = payload.tensors["U"].clone()
        confine([stage], self.U, self.token_fixed)


@implements(SsnKind)
class SsnBoundary(Boundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        if "ssn_basis" not in shared:  # one basis for every boundary of the replica
            own = cfg.settings()
            token_fixed = model.get_input_embeddings().weight.detach().float().clone()
            shared["ssn_basis"] = SubspaceBasis(hidden_size, cfg.rank, seed, token_fixed, own.refresh_every,
                                                own.refresh_lr)
        basis = shared["ssn_basis"]
        return cls(index, hidden_size, basis, basis.token_fixed, wire_dtype)

    def __init__(self, index: int, hidden_size: int, basis: SubspaceBasis, token_fixed: torch.Tensor,
                 wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, wire_dtype)
        self.basis = basis
        if token_fixed is not basis.token_fixed:
            raise ValueError("an SSN boundary computes with its basis's token_fixed (one copy per replica)")
        self.rank = basis.U.shape[1]

    @property
    def token_fixed(self) -> torch.Tensor:
        """(V, d), frozen, shared by all boundaries of a replica (held by the basis, on its device)."""
        return self.basis.token_fixed

    @property
    def stage_state(self) -> SubspaceBasis:
        return self.basis

    def attach(self, sender, receiver) -> None:
        if sender.is_first:  # stage 0 owns the basis (it is checkpointed there)
            sender.boundary_modules["ssn_basis"] = self.basis

    def residual_offset(self, ids):
        return self.token_fixed[ids]

    def subspace(self):
        return self.basis.U.detach()

    def encode(self, x, ctx):
        z = (x - self.token_fixed[ctx.input_ids]) @ self.basis.use("send", self.index)
        return z, Payload({"z": self._to_wire(z), "ids": ctx.input_ids.to(id_dtype(self.token_fixed.shape[0]))})

    def decode(self, payload, ctx):
        return payload.tensors["z"]

    def lift(self, z_hat, payload, ctx):
        return z_hat @ self.basis.use("recv", self.index).T + self.token_fixed[payload.tensors["ids"].long()]

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
