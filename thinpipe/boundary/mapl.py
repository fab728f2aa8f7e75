"""MAPL: a learned Stiefel projector per boundary with factorized per-stage offsets (MAPL §3.2-3.3).

Boundary p between stage p (sender) and stage p+1 (receiver)::

    sender:    Z = (X - offset_p[ids]) A_p                    (B, T, r)   eq. (1)
    wire:      Z (r values per token) + token ids (integers)
    receiver:  X_hat = Z A_p^T + offset_{p+1}[ids]             (B, T, d)   eq. (2)
    backward:  dL/dZ (r values per token) travels back through the same A_p

``offset_p`` is the token embedding on the first boundary and stage p's own offset after that;
``offset_p[ids] = E_p^small[ids] P_p`` with a trainable (V, r) table and a frozen random orthonormal
(r, d) P_p (eq. 3). Table 6's alternatives are ``boundary.offset = none | static | full``. The paper
calls this per-stage offset the stage "anchor"; here it is the *offset*, so that "anchor" means
only the anchor circuit (``thinpipe/anchor/``).

Ownership (docs/architecture.md: the boundary contract): A_p belongs to the sender stage (it is
registered there, so its optimizer, DP sync and checkpoint are the sender's); the receiver computes
with a copy. After each backward the receiver returns its gradient contribution dL/dA_p (d x r
fp32) and after each optimizer step the owner sends the new A_p (d x r fp32): both on the
``pp_params`` axis. Each stage's offset lives on that stage, used on its input (receiver side) and
output (sender side), so it is never sent. The boundary is part of the model (``architectural``):
evaluation runs through it.
"""

from __future__ import annotations

import torch
from torch import nn

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.config.boundary_kinds import MaplKind
from thinpipe.optim.stiefel import orthonormal

OFFSET_MODES = ("factorized", "full", "static", "none")


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest signed integer type that holds every token id."""
    return torch.int16 if vocab_size <= 2 ** 15 else torch.int32


class Projector(nn.Module):
    """A_p in St(d, r), a parameter of the sender stage."""

    def __init__(self, A: torch.Tensor, trainable: bool = True):
        super().__init__()
        self.A = nn.Parameter(A, requires_grad=trainable)


class StageOffset(nn.Module):
    """A stage's token-dependent offset offset[ids] (B, T, d), per MAPL eq. (3) and Table 6 (the
    paper's stage "anchor").

    factorized: E_small (V, r) trainable @ P (r, d) frozen, rows orthonormal. E_small starts as the
    token embedding seen through P (E_tok P^T), so at step 0 the offset is the part of the token
    embedding inside span(P^T) rather than nothing.
    full: a trainable (V, d) table starting at E_tok. static: E_tok, frozen. none: zero."""

    P: torch.Tensor  # the factorized offset's frozen buffer (registered in __init__), typed for the checker

    def __init__(self, mode: str, token_embedding: torch.Tensor, rank: int, generator: torch.Generator):
        super().__init__()
        if mode not in OFFSET_MODES:
            raise ValueError(f"unknown offset mode {mode!r}; choose one of {OFFSET_MODES}")
        self.mode = mode
        E = token_embedding.detach().float()
        if mode == "factorized":
            P = orthonormal(E.shape[1], rank, generator).T.contiguous()  # (r, d)
            self.register_buffer("P", P)
            self.small = nn.Parameter(E @ P.T)
        elif mode == "full":
            self.table = nn.Parameter(E.clone())
        elif mode == "static":
            self.register_buffer("table", E.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.mode == "factorized":
            return self.small[ids] @ self.P
        if self.mode in ("full", "static"):
            return self.table[ids]
        return None


def _rename_legacy_keys(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: checkpoints written before the per-stage "anchor" became the
    "offset" hold ``anchor.*`` (the boundary's own state dict); load them as ``offset.*``."""
    for key in [k for k in state_dict if k.startswith(f"{prefix}anchor.")]:
        state_dict[f"{prefix}offset.{key[len(prefix) + len('anchor.'):]}"] = state_dict.pop(key)


@implements(MaplKind)
class MaplBoundary(Boundary):

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        emb = model.get_input_embeddings().weight
        return cls(index, hidden_size, cfg.rank, emb.shape[0], emb, seed, **cls._options(cfg, wire_dtype))

    @staticmethod
    def _options(cfg, wire_dtype) -> dict:
        return dict(offset=cfg.offset, trainable=cfg.projector_optim != "fixed", wire_dtype=wire_dtype,
                    pca_start=cfg.init == "pca")

    def __init__(self, index: int, hidden_size: int, rank: int, vocab_size: int, token_embedding: torch.Tensor,
                 seed: int, offset: str = "factorized", trainable: bool = True,
                 wire_dtype: torch.dtype | None = None, pca_start: bool = False):
        super().__init__(index, hidden_size, wire_dtype)
        if not 1 <= rank <= hidden_size:
            raise ValueError(f"boundary.rank must be in [1, {hidden_size}], got {rank}")
        self.rank, self.vocab_size = rank, vocab_size
        gen = torch.Generator().manual_seed(seed * 1009 + index)
        self.projector = Projector(orthonormal(hidden_size, rank, gen), trainable)
        self.offset = StageOffset(offset, token_embedding, rank, gen)  # the receiving stage's offset
        self.A_copy = self.projector.A.detach().clone().requires_grad_(trainable)  # receiver's copy
        self.sender_offset = None  # set by attach(): the sender stage's embedding or offset
        self.pca_start = pca_start  # boundary.init = pca: the data-driven start (``init_from_residuals``)
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    # wiring ----------------------------------------------------------------------------------------
    def attach(self, sender, receiver) -> None:
        """Register the owned modules on the stages that own them (so optimizers, DP sync and
        checkpoints see them) and find the sender's offset."""
        sender.boundary_modules["out_projector"] = self.projector
        receiver.boundary_modules["in_offset"] = self.offset
        self.sender_offset = sender.embed_tokens if sender.is_first else sender.boundary_modules["in_offset"]

    # analysis and the PCA start (boundary contract hooks) ---------------------------------------
    def residual_offset(self, ids):
        offset = self.sender_offset(ids)
        return torch.zeros(()) if offset is None else offset  # X - E[ids] (or the sender's offset), MAPL Fig. 3

    def subspace(self):
        return self.projector.A.detach()

    @property
    def wants_residual_init(self) -> bool:
        return self.pca_start

    @torch.no_grad()
    def init_from_residuals(self, residuals: torch.Tensor) -> Payload:
        """The data-driven start: A_p = the top-r right singular vectors of the residuals it will see."""
        _, _, Vh = torch.linalg.svd(residuals.double(), full_matrices=False)
        return Payload({"A": Vh[:self.rank].T.to(self.projector.A.dtype)})

    @torch.no_grad()
    def load_init(self, payload: Payload) -> None:
        A = payload.tensors["A"]
        self.projector.A.copy_(A)
        self.receiver_load_params(self.owner_params() or Payload({"A": A}))

    # sender -------------------------------------------------------------------------------------
    def encode(self, x, ctx):
        offset = self.sender_offset(ctx.input_ids)
        z = (x if offset is None else x - offset) @ self.projector.A
        return z, Payload({"z": self._to_wire(z), "ids": ctx.input_ids.to(id_dtype(self.vocab_size))})

    def decode_grad(self, payload, ctx):
        return payload.tensors["g"]

    # receiver -----------------------------------------------------------------------------------
    def decode(self, payload, ctx):
        return payload.tensors["z"]

    def lift(self, z_hat, payload, ctx):
        x_hat = z_hat @ self.A_copy.T
        offset = self.offset(payload.tensors["ids"].long())
        return x_hat if offset is None else x_hat + offset

    def encode_grad(self, g, ctx):
        return Payload({"g": self._to_wire(g)})

    # projector sync (pp_params axis) --------------------------------------------------------------
    @property
    def has_shared_params(self) -> bool:
        return self.projector.A.requires_grad

    def receiver_param_grads(self) -> Payload | None:
        """Receiver -> owner: the copy's gradient contribution (then cleared)."""
        if not self.has_shared_params:
            return None
        g, self.A_copy.grad = self.A_copy.grad, None
        return Payload({"dA": torch.zeros_like(self.A_copy) if g is None else g})

    def owner_absorb_grads(self, payload: Payload) -> None:
        A = self.projector.A
        A.grad = payload.tensors["dA"].clone() if A.grad is None else A.grad + payload.tensors["dA"]

    def owner_params(self) -> Payload | None:
        """Owner -> receiver after the optimizer step: the new A_p."""
        return Payload({"A": self.projector.A.detach().clone()}) if self.projector.A.requires_grad else None

    @torch.no_grad()
    def receiver_load_params(self, payload: Payload) -> None:
        self.A_copy.copy_(payload.tensors["A"])

    # accounting ---------------------------------------------------------------------------------
    def expected_bytes(self, tokens, element_size):
        ids = tokens * torch.empty(0, dtype=id_dtype(self.vocab_size)).element_size()
        return tokens * self.rank * element_size + ids, tokens * self.rank * element_size

    def expected_param_bytes(self) -> int:
        """Per optimizer step: dA up + A down, fp32."""
        return 2 * self.hidden_size * self.rank * 4 if self.projector.A.requires_grad else 0
