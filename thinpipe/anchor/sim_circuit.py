"""Anchor circuit in the single-process simulation, with deterministic delivery.

One anchor replica of the pipeline (paper §3, Z = 1). A cycle started at fast step t
  1. pulls the fast circuit's weights w_t (one fast replica's stages; bytes on the ``anchor`` axis),
  2. runs an unmasked forward-backward on its own data shard with dense boundaries (its PP
     traffic is metered on the ``anchor`` axis too: it is not on the fast circuit's links),
  3. pushes the gradient back to every fast replica (bytes on the ``anchor`` axis), dense or as
     PowerSGD factors P, Q (``anchor.push_rank``; error feedback kept on the anchor side),
and the prior is consumed by the spectral-correction optimizer at step t + delta exactly (App. H:
the cycle takes ~delta fast steps). By default a new cycle starts every delta steps, as one
replica would manage; ``anchor.every`` < delta models concurrent cycles (H.5).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from thinpipe.anchor.anchor_pass import run_anchor_pass, staleness_stats
from thinpipe.anchor.codec import decode_push, encode_pull, encode_push, load_pull, trained
from thinpipe.boundary import Boundary
from thinpipe.dp.powersgd import PowerSGDState
from thinpipe.models.stages import Stage, build_stages
from thinpipe.rank.context import MicrobatchContext
from thinpipe.rank.from_config import configure_stage
from thinpipe.rank.schedule import SCHEDULES, serial_order
from thinpipe.rank.worker import StageWorker


@dataclass
class AnchorPrior:
    produced_step: int
    due_step: int
    grads: list[dict[str, torch.Tensor]]  # per stage: local param name -> gradient at w_produced


class SimAnchorCircuit:
    def __init__(self, model, cfg, mailbox, meter, wire_dtype, compute_dtype, replica_tag: int):
        m, t = cfg.mesh, cfg.train
        self.cfg, self.meter, self.wire_dtype = cfg, meter, wire_dtype
        self.staleness = cfg.anchor.staleness
        self.every = cfg.anchor.every or cfg.anchor.staleness
        # The same parameters train as in the fast circuit (with LoRA: the adapters only).
        self.stages: list[Stage] = [configure_stage(st, cfg) for st in build_stages(model, m.fixed_split, m.pp)]
        hidden = model.config.hidden_size
        boundaries = [Boundary(b, hidden, wire_dtype) for b in range(m.pp - 1)]
        self.workers = [StageWorker(st, replica_tag, boundaries[s - 1] if s else None,
                                    boundaries[s] if s < m.pp - 1 else None, mailbox, compute_dtype,
                                    axes=("anchor", "anchor"))
                        for s, st in enumerate(self.stages)]
        self.replica_tag = replica_tag
        self.push = ([PowerSGDState(rank=cfg.anchor.push_rank, start_step=0, seed=t.seed + s) for s in range(m.pp)]
                     if cfg.anchor.push_rank else None)
        self.pending: deque[AnchorPrior] = deque()
        self.staleness_seen: list[int] = []

    def starts_at(self, step: int) -> bool:
        return step % self.every == 0

    @torch.enable_grad()
    def run_cycle(self, step: int, fast_stages: list[Stage], ctxs: list[MicrobatchContext], fast_replicas: int) -> None:
        """Pull w_step from ``fast_stages``, run the unmasked pass of ``ctxs`` (``Objective.anchor_contexts``),
        queue the prior for step + delta. Pull and push go through ``anchor/codec.py``, as on the real mesh."""
        for mine, theirs in zip(self.stages, fast_stages):
            flat = encode_pull(trained(theirs), self.wire_dtype)
            load_pull(trained(mine), flat)
            self.meter.add("anchor", flat.nbytes)
        order = serial_order(SCHEDULES[self.cfg.train.schedule](self.cfg.mesh.pp, len(ctxs)))
        grads = run_anchor_pass(self.workers, order, ctxs)
        received = []
        for s, g in enumerate(grads):
            push = encode_push(g, self.push[s] if self.push else None, self.wire_dtype)
            self.meter.add("anchor", sum(t.nbytes for t in push.values()) * fast_replicas)
            received.append(decode_push(push, g, self.cfg.anchor.push_rank))
        self.pending.append(AnchorPrior(step, step + self.staleness, received))

    def due(self, step: int) -> list[AnchorPrior]:
        """Priors whose delivery step is ``step`` (never earlier)."""
        out = []
        while self.pending and self.pending[0].due_step <= step:
            prior = self.pending.popleft()
            assert prior.due_step == step, "a prior was skipped"
            self.staleness_seen.append(step - prior.produced_step)
            out.append(prior)
        return out

    def summary(self) -> dict:
        """What the distributed engine measures too; the simulation delivers exactly, never waits."""
        return {**staleness_stats(self.staleness_seen), "anchor_delivery": "fixed", "anchor_wait_s": 0.0,
                "anchor_failed": False, "anchor_pulls_skipped": 0}

    def state_dict(self) -> dict:
        return {"pending": [(p.produced_step, p.due_step, p.grads) for p in self.pending],
                "staleness_seen": list(self.staleness_seen),
                "push": [st.state_dict() for st in self.push] if self.push else None}

    def load_state_dict(self, state: dict) -> None:
        self.pending = deque(AnchorPrior(*p) for p in state["pending"])
        self.staleness_seen = list(state["staleness_seen"])
        for st, sd in zip(self.push or [], state.get("push") or []):
            st.load_state_dict(sd)
