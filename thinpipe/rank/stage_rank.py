"""One stage of one fast replica and everything it does in a step (the unit both engines run: docs/architecture.md).

A ``StageRank`` owns its stage module, its two boundaries, its optimizer and its DP state, and
talks to other ranks only through a transport (point-to-point payloads) and two groups (its
stage's DP group, its replica's PP group). DP averages divide by the DP group's ``size``: the
mesh's ``dp``, or, across elastic replicas, the replicas in the current quorum. Each phase of a
step that talks to other ranks is a generator yielding a ``Work`` whenever it has posted something
others must take part in: the
single-process simulation advances every rank's phase in lockstep (``drive_lockstep``), a real
process runs its own phase to the end, waiting on each ``Work``. The math is identical either way.

Phase order per step (``begin_step`` before the pipeline's forward/backward; ``phases`` after it):
  exchange_boundary_grads  receivers return dL/d(shared boundary params) to their owners
  dp_sync                  the DP scheme's per-step gradient average (all-reduce / PowerSGD) in the stage's DP group
  tied_sync                first and last stage exchange the tied-embedding gradients, both apply the sum
  clip_and_step            global-norm clip over the replica's stages, anchor priors, optimizer step
  outer_steps              the DP scheme's work after the step (DiLoCo's outer step, Streaming DiLoCo's fragments)
  broadcast_boundary_params owners send the updated shared boundary params to the other end
  refresh_up / _average / _down   a boundary stage state's periodic refresh (the SSN basis), or its
                           per-step hook (``StageState`` in boundary/base.py)

Every message is tagged with a typed tag (``comm/tags.py``); nothing here knows a boundary kind or a DP
scheme (``dp/scheme.py: DPScheme``, built by ``dp.kind``).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from thinpipe.comm.header import Expect
from thinpipe.comm.payload import Payload
from thinpipe.comm.protocols import Group, Transport
from thinpipe.comm.tags import ParamGrads, Params, RefreshDown, RefreshUp, TiedGrad
from thinpipe.comm.work import DONE
from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.registry import build_scheme
from thinpipe.optim import clip_coefficient, tensor_norms
from thinpipe.optim.build import build_stage_optimizer
from thinpipe.rank.worker import StageWorker

MAX_TENSORS = 1 << 16  # parameter tensors of one stage, at most: the bound of a stage's gradient-norm vector


class StageRank:
    def __init__(self, cfg, stage, replica: int, in_boundary, out_boundary, transport: Transport,
                 dp_group: Group, pp_group: Group, compute_dtype: torch.dtype):
        self.cfg, self.stage, self.replica, self.index = cfg, stage, replica, stage.index
        self.in_boundary, self.out_boundary = in_boundary, out_boundary
        self.transport, self.dp_group, self.pp_group = transport, dp_group, pp_group
        ends = [b for b in (in_boundary, out_boundary) if b is not None]
        self.stage_state = ends[0].stage_state if ends else None
        if self.stage_state is not None:
            self.stage_state.after_step(stage)  # the invariant holds from the start (before any copy is taken)
        self.worker = StageWorker(stage, replica, in_boundary, out_boundary, transport, compute_dtype)
        self.optimizer = build_stage_optimizer(stage, cfg, self.index)
        # the configured DP scheme (dp/scheme.py), bound to what trains here and this stage's DP group; its seed
        # is equal on every replica of the stage and distinct per stage
        self.dp_scheme = build_scheme(cfg.dp, self.trained, dp_group, replica, cfg.train.seed * 7 + self.index)
        self.tied_param = self._tied_param()
        self._refresh_total: Payload | None = None  # stage 0, during a refresh: the summed contributions
        self.last_grad_norm = 0.0
        self.router_aux = 0.0  # this stage's router loss in the last step's schedule (models/router_loss.py)

    def trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of what trains: a DP scheme's global copy and outer syncs cover only these
        (with LoRA, the adapters; a frozen base never moves, so syncing it would send zeros)."""
        return [(n, p) for n, p in self.stage.named_parameters() if p.requires_grad]

    def trainable_count(self) -> int:
        """Parameters that train on this stage, a tied matrix's second copy (the last stage's) not
        counted again: summed over a replica's stages, the model's trainable parameters."""
        n = sum(p.numel() for p in self.stage.parameters() if p.requires_grad)
        return n - (self.tied_param.numel() if self.tied_param is not None and self.stage.is_last else 0)

    def model_count(self) -> int:
        """This stage's parameters of the model itself (LoRA adapters left out), a tied matrix's second copy not
        counted again: summed over a replica's stages, the model's parameter count (``summary.json: params``)."""
        n = sum(p.numel() for name, p in self.stage.named_parameters() if "lora_" not in name)
        return n - (self.tied_param.numel() if self.tied_param is not None and self.stage.is_last else 0)

    def _tied_param(self):
        """The tied matrix this stage holds a copy of, when the first and last stage differ (and it
        trains: frozen copies stay equal without a sync)."""
        st, m = self.stage, self.cfg.mesh
        if self.cfg.model.tied != "sync" or m.pp < 2 or not st.tied_embeddings:
            return None
        p = st.embed_tokens.weight if st.is_first else st.lm_head.weight if st.is_last else None
        return p if p is not None and p.requires_grad else None

    # -------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Before this step's forward."""
        if self.stage_state is not None:
            self.stage_state.before_step(step)
        self.stage.take_router_aux()  # forwards since the last schedule (an anchor cycle's) are not this step's

    def phases(self, step: int, lr: float, prior_grads: list[dict], mix: float) -> list[Generator]:
        """This rank's phases of step ``step`` after its pipeline schedule, in order (module docstring).
        An engine runs the i-th phase of every rank before any rank's (i+1)-th."""
        self.router_aux = self.stage.take_router_aux()  # the schedule's, before any anchor forward
        return [self.exchange_boundary_grads(), self.dp_sync(step), self.tied_sync(),
                self.clip_and_step(lr, prior_grads, mix), self.outer_steps(step), self.broadcast_boundary_params(),
                self.refresh_up(step), self.refresh_average(step), self.refresh_down(step)]

    def exchange_boundary_grads(self) -> Generator:
        if self.in_boundary is not None and self.in_boundary.has_shared_params:
            self.transport.send(ParamGrads(self.replica, self.in_boundary.index),
                                self.in_boundary.receiver_param_grads(), "pp_params")
        yield DONE
        if self.out_boundary is not None and self.out_boundary.has_shared_params:
            self.out_boundary.owner_absorb_grads(self.transport.recv(ParamGrads(self.replica, self.out_boundary.index),
                                                                     self.out_boundary.param_expect()))

    def dp_sync(self, step: int) -> Generator:
        """The DP scheme's per-step gradient average (or nothing), over every gradient of the stage."""
        grads = {n: p.grad for n, p in self.stage.named_parameters() if p.grad is not None}
        yield from self.dp_scheme.sync_grads(step, grads)

    def tied_sync(self) -> Generator:
        p = self.tied_param
        if p is None:
            return
        # tags name the receiving end, so the two messages of the exchange stay distinct
        first = self.stage.is_first
        mine = Payload({"g": p.grad.detach().clone()})
        self.transport.send(TiedGrad(self.replica, to_first=not first), mine, "tied")
        yield DONE
        other = self.transport.recv(TiedGrad(self.replica, to_first=first), Expect.like(mine)).tensors["g"]
        # The same sum on both ends (embedding's + head's), so the two copies stay equal bitwise: a float
        # addition is commutative, and adding in place spares a fresh tensor of the embedding's size.
        p.grad.add_(other)

    def clip_and_step(self, lr: float, prior_grads: list[dict], mix: float) -> Generator:
        """Clip by the replica's global gradient norm (every stage's per-tensor norms gathered in stage
        order: the reduction of the unsplit model), fold in anchor priors, step."""
        norms = tensor_norms(self.stage.parameters_in_model_order())
        work, gathered = self.pp_group.all_gather(self.index, norms, MAX_TENSORS)
        yield work
        total, coef = clip_coefficient(torch.cat(gathered), self.cfg.train.grad_clip)
        params = list(self.stage.parameters())
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for grads in prior_grads:
            self.optimizer.receive_prior(grads)
            if mix:
                self._mix_anchor(grads, mix)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_grad_norm = total

    @torch.no_grad()
    def _mix_anchor(self, grads: dict[str, torch.Tensor], mix: float) -> None:
        """Variant ``anchor.mix``: add the stale anchor gradient itself, as asynchronous SGD would."""
        for name, p in self.stage.named_parameters():
            if name in grads and p.grad is not None:
                p.grad.add_(grads[name], alpha=mix)

    def outer_steps(self, step: int) -> Generator:
        """The DP scheme's work after the optimizer step (DiLoCo's outer step, Streaming DiLoCo's fragments)."""
        yield from self.dp_scheme.after_step(step)

    def broadcast_boundary_params(self) -> Generator:
        if self.out_boundary is not None and self.out_boundary.has_shared_params:
            self.transport.send(Params(self.replica, self.out_boundary.index), self.out_boundary.owner_params(),
                                "pp_params")
        yield DONE
        if self.in_boundary is not None and self.in_boundary.has_shared_params:
            self.in_boundary.receiver_load_params(self.transport.recv(Params(self.replica, self.in_boundary.index),
                                                                      self.in_boundary.param_expect()))

    # a boundary stage state's refresh (boundary/base.py: StageState) ------------------------------
    def _refreshing(self, step: int) -> bool:
        return self.stage_state is not None and self.stage_state.refresh_due(step)

    def refresh_up(self, step: int) -> Generator:
        """Contributions summed up the pipeline, one stage per round (last stage first), so that
        every rank of a replica takes part in the same number of rounds."""
        if not self._refreshing(step):
            return
        state, s, last = self.stage_state, self.index, self.stage.num_stages - 1
        assert state is not None  # _refreshing: a state whose refresh is due
        mine = self._refresh_mine = state.contribution(self.in_boundary, self.out_boundary)
        for turn in range(last, -1, -1):
            if turn == s:
                total = state.combine(self.transport.recv(RefreshUp(self.replica, s), Expect.like(mine)), mine) \
                    if s < last else mine
                if s > 0:
                    self.transport.send(RefreshUp(self.replica, s - 1), total, "pp_params")
                else:
                    self._refresh_total = total
            yield DONE

    def refresh_average(self, step: int) -> Generator:
        """Stage 0: the sum's mean over the DP replicas."""
        if self._refreshing(step) and self.index == 0 and self.dp_group.size > 1:
            assert self._refresh_total is not None  # refresh_up left stage 0 the sum this step
            yield from allreduce_average(self._refresh_total.tensors, self.dp_group, self.replica, self.dp_group.size)

    def refresh_down(self, step: int) -> Generator:
        """Stage 0 computes the new state; it travels down; every stage applies it. Without a
        refresh: the state's per-step hook."""
        if not self._refreshing(step):
            if self.stage_state is not None:
                self.stage_state.after_step(self.stage)
            return
        state, s = self.stage_state, self.index
        assert state is not None  # _refreshing: a state whose refresh is due
        for turn in range(self.stage.num_stages):
            if turn == s:
                new = state.update(self._refresh_total) if s == 0 else \
                    self.transport.recv(RefreshDown(self.replica, s - 1), state.update_expect(self._refresh_mine))
                if s < self.stage.num_stages - 1:
                    self.transport.send(RefreshDown(self.replica, s), new, "pp_params")
                state.apply(new, self.stage)
            yield DONE
        self._refresh_total = self._refresh_mine = None

    # -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # the DP scheme's keys sit beside the stage's and the optimizer's (checkpoints of every version load)
        return {"stage": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.dp_scheme.state_dict()}

    def load_state_dict(self, state: dict) -> Generator:
        """Restore; the DP scheme re-posts the syncs it saved in flight, a phase (it talks to the DP group)."""
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])
        yield from self.dp_scheme.load_state_dict(state)
