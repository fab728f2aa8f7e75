"""The PP boundary protocol (docs/architecture.md: the boundary contract), written once for every compressor.

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

Learned and stateful kinds extend the contract with hooks (defaults: nothing to do), so that no
engine ever knows a kind by name (docs/architecture.md, "The boundary contract"):
  shared parameters   one end owns them, the other computes with a copy: receiver_param_grads ->
                      owner_absorb_grads after the backward, owner_params -> receiver_load_params
                      after the optimizer step (MAPL's projector); bytes on ``pp_params``
  residual_offset     the token-deterministic part of the sender's activation the boundary does not
                      send (MAPL's offset, SSN's fixed embedding): what analysis subtracts
  subspace            the (d, r) orthonormal basis the boundary sends in, for analysis
  residual start      wants_residual_init / init_from_residuals / load_init: a data-driven start
                      from the residuals the boundary will see (MAPL's PCA start)
  stage_state         a ``StageState`` shared by every boundary of a replica and held by every stage,
                      with a per-step hook and a periodic refresh phase that the ranks run over the
                      wire (SSN's basis and its Grassmann refresh); bytes on ``pp_params``
"""

from __future__ import annotations

import torch
from torch import nn

from thinpipe.comm.header import Expect
from thinpipe.comm.payload import Payload
from thinpipe.config.boundary_kinds import IdentityKind
from thinpipe.plugins import BoundaryKind


def implements(*kinds: type[BoundaryKind]):
    """Class decorator: the ``Boundary`` class builds these kinds (``from_config``), whose descriptions
    (``plugins.py: BoundaryKind``: settings and properties, torch-free, a layer below) name it from now on."""
    def mark(cls):
        cls.spec = kinds[0]
        for kind in kinds:
            kind.implementation = cls
        return cls
    return mark


class Boundary(nn.Module):
    """Base class: the dense (identity) boundary. Subclasses override what they compress."""

    spec: type[BoundaryKind] = IdentityKind  # the kind's description (``implements``; an instance may name its own)
    # True: a forward changes the boundary's state (AQ-SGD's buffers, MAPL-VQ's streaming codebooks), so two
    # forwards of one sequence differ; RL's old-log-prob pass needs them equal and refuses such a kind.
    forward_state = False

    def __init__(self, index: int, hidden_size: int, wire_dtype: torch.dtype | None = None):
        super().__init__()
        self.index, self.hidden_size, self.wire_dtype = index, hidden_size, wire_dtype

    @classmethod
    def from_config(cls, cfg, index: int, hidden_size: int, seed: int, wire_dtype: torch.dtype | None, model,
                    shared: dict) -> Boundary:
        """Boundary ``index`` as ``cfg`` (the ``[boundary]`` section; ``cfg.settings()``: the kind's own table)
        configures it; ``model`` (the learned kinds' embedding) and ``shared`` (state the replica's boundaries
        share) as ``plugins.py: BoundaryKind.build`` describes."""
        return cls(index, hidden_size, wire_dtype)

    @property
    def kind(self) -> str:
        return self.spec.name

    @property
    def architectural(self) -> bool:
        """True: part of the model (evaluation runs through it); False: a wire codec. The kind says."""
        return self.spec.architectural

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

    # boundary parameters (docs/architecture.md: shared parameters): none here --------------------
    @property
    def has_shared_params(self) -> bool:
        """True: one end owns parameters the other end computes with (synced per step)."""
        return False

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

    def receiver_keeps(self, key: str) -> bool:
        """Whether the receiving end keeps state entry ``key`` (this module's ``state_dict`` key) up to date; the
        sending end keeps the rest (``merged_state``)."""
        return False

    def merged_state(self, sender: dict, receiver: dict) -> dict:
        """This boundary's ``state_dict`` from its two ends' saved copies (a dist job's ranks, each holding the
        whole object but updating only its own end's entries, the other stage's placeholders left out):
        ``engine/run_parts.py`` puts a job's model together with it. An entry from the end that keeps it."""
        return {k: receiver[k] if k in receiver and (self.receiver_keeps(k) or k not in sender) else sender[k]
                for k in {*sender, *receiver}}

    # learned / stateful kinds (see the module docstring) ---------------------------------------
    @property
    def stage_state(self) -> StageState | None:
        """The ``StageState`` every boundary of the replica shares (see the module docstring); None: none."""
        return None

    def residual_offset(self, ids: torch.Tensor) -> torch.Tensor | None:
        """(B, T, d): the part of the sender's activation that is a function of the tokens alone and
        is not sent; None: the boundary has none (analysis then subtracts the token embedding)."""
        return None

    def subspace(self) -> torch.Tensor | None:
        """The (d, r) orthonormal basis payloads are expressed in (for analysis); None: none."""
        return None

    @property
    def wants_residual_init(self) -> bool:
        """True: before training, the engine runs the data through the pipeline up to this boundary
        and calls ``init_from_residuals`` on its sender, then ``load_init`` on every copy."""
        return False

    def init_from_residuals(self, residuals: torch.Tensor) -> Payload:
        """Sender, replica 0: the start computed from the (tokens, d) residuals at this boundary
        (activation minus ``residual_offset``), as the payload every copy loads."""
        raise NotImplementedError

    def load_init(self, payload: Payload) -> None:
        """Every copy of this boundary (both ends, every replica) loads the start."""
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

    def planned_bytes(self, tokens: int, element_size: int) -> tuple[float, float]:
        """(forward, backward) bytes of ``tokens`` tokens of steady training: what ``thinpipe plan`` counts
        (``plan/planner.py: activation_fraction``, at a token count large enough that no rounding shows).
        ``expected_bytes``, unless a kind's payload depends on the data and it plans with a bound (``klt``)."""
        return self.expected_bytes(tokens, element_size)

    def max_bytes(self, tokens: int, element_size: int) -> tuple[int, int]:
        """(forward, backward) upper bounds on one payload's bytes, what a receiver accepts: the
        exact ``expected_bytes`` for every kind whose payload length is fixed; a kind whose length
        depends on the data overrides this with a true bound."""
        return self.expected_bytes(tokens, element_size)

    def payload_expect(self, direction: str, tokens: int, ctx=None) -> Expect:
        """What the receiving end of ``direction`` ("fwd": the activation, "bwd": its gradient)
        accepts for a microbatch of ``tokens`` tokens (docs/security.md: receivers decide what they
        allocate). Without a wire dtype an activation crosses in the compute dtype: fp32 at most.
        ``ctx`` (the microbatch's context, when the caller has it) lets a kind whose payload depends
        on what both ends know of the batch (``klt``: its loss tokens) name the exact tensors."""
        size = torch.empty(0, dtype=self.wire_dtype).element_size() if self.wire_dtype is not None else 4
        fwd, bwd = self.max_bytes(tokens, size)
        return Expect(max_bytes=fwd if direction == "fwd" else bwd)

    def param_expect(self) -> Expect:
        """What either end accepts of a shared-parameter message (gradients up, parameters down): no
        more than this boundary's own tensors hold in fp32."""
        return Expect(max_bytes=sum(t.numel() * max(4, t.element_size()) for t in self.state_dict().values()
                                    if isinstance(t, torch.Tensor)))


class StageState:
    """State that every boundary of a replica shares and every stage holds a copy of (the SSN basis).

    The rank calls ``before_step`` before its forward, ``after_step`` after its optimizer step on a
    step without a refresh, and on a step where ``refresh_due``, the refresh phase
    (``rank/stage_rank.py: StageRank.refresh``): every stage's ``contribution`` is summed up the
    pipeline (``combine``: later stages' sum, then this stage's), stage 0 averages it over the DP
    replicas and computes the new state (``update``), which travels back down; every stage
    ``apply``s it. Every message is a real payload on ``pp_params``. The object may be shared by
    several ranks (the simulation holds one per replica): every method is idempotent per step.
    """

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, stage) -> None:
        pass

    def refresh_due(self, step: int) -> bool:
        return False

    def contribution(self, in_boundary, out_boundary) -> Payload:
        """This stage's part of the refresh input (from its uses of the state at its two ends)."""
        raise NotImplementedError

    def update_expect(self, contribution: Payload) -> Expect:
        """What a stage accepts of the refreshed state travelling down: by default the tensors of a
        contribution (the state's own shapes); a state whose update differs overrides this."""
        return Expect.like(contribution)

    @staticmethod
    def combine(later: Payload, mine: Payload) -> Payload:
        return Payload({k: later.tensors[k] + v for k, v in mine.tensors.items()})

    def update(self, total: Payload) -> Payload:
        """Stage 0, after the DP average: the refreshed state."""
        raise NotImplementedError

    def apply(self, payload: Payload, stage) -> None:
        raise NotImplementedError


implements(IdentityKind)(Boundary)
