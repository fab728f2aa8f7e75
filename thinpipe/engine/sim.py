"""Single-process simulation of the mesh: ``dp`` fast replicas x ``pp`` stages, exactly.

Every replica holds its own copy of every stage and its own optimizers, as real workers would; the
PP transport is an in-process mailbox and the DP group an in-process collective, both metered. The
step is: run every replica's pipeline schedule -> DP sync per stage -> tied-embedding sync ->
global-norm clip -> optimizer step (-> DiLoCo outer step every H steps). DP algorithms are
generators over one rank's tensors (``thinpipe.dp``), driven here in lockstep over the replicas. With ``mesh.anchor = 1`` an anchor circuit runs an
unmasked cycle on the step's weights every ``anchor.every`` steps, and the priors due at a step are
folded into each stage's spectral-correction optimizer just before it steps (§3.2, §3.4).
"""

from __future__ import annotations

import torch

from thinpipe.anchor import SimAnchorCircuit
from thinpipe.boundary import Payload, build_boundaries
from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.boundary.ssn import confine
from thinpipe.comm import ByteMeter, InFlight, InProcessGroup, Mailbox, drive_lockstep
from thinpipe.config import Config
from thinpipe.dp import DiLoCoState, PowerSGDState, allreduce_average, outer_step, powersgd_average
from thinpipe.dp.streaming import StreamingState, fragment_deltas, fragment_sync, sync_start_steps
from thinpipe.engine.context import make_contexts
from thinpipe.engine.diagnostics import gradient_diagnostics
from thinpipe.engine.schedule import SCHEDULES, serial_order
from thinpipe.engine.worker import StageWorker
from thinpipe.models.stages import Stage, build_stages, tied_pair
from thinpipe.optim import clip_coefficient, cosine_with_warmup, tensor_norms
from thinpipe.optim.build import build_stage_optimizer
from thinpipe.optim.stiefel import grassmann_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def wire_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype activations and their gradients travel in (None: as computed, i.e. fp32)."""
    name = cfg.train.dtype if cfg.boundary.dtype == "auto" else cfg.boundary.dtype
    return None if name == "float32" else DTYPES[name]


class SimMesh:
    def __init__(self, model, cfg: Config):
        self.cfg = cfg
        t, m = cfg.train, cfg.mesh
        self.compute_dtype = DTYPES[t.dtype]
        wire = wire_dtype(cfg)
        self.meter = ByteMeter()
        self.mailbox = Mailbox(self.meter)
        hidden = model.config.hidden_size
        # One boundary object per link and replica, holding both ends (in simulation both ends are
        # this process). Learned kinds register their parameters on the stage that owns them; the
        # other end computes with a copy that is synced over the wire (``sync_boundary_*``).
        self.replicas: list[list[Stage]] = [build_stages(model, m.split or None, m.pp) for _ in range(m.dp)]
        self.replica_boundaries = [build_boundaries(cfg.boundary, m.pp, hidden, t.seed, wire, model)
                                   for _ in range(m.dp)]
        for stages, bounds in zip(self.replicas, self.replica_boundaries):
            for b in bounds:
                b.attach(stages[b.index], stages[b.index + 1])
        self.boundaries = self.replica_boundaries[0]
        self.ssn = cfg.boundary.kind == "ssn" and m.pp > 1
        if self.ssn:
            self.confine_all()
        self.workers = [[StageWorker(st, r, bounds[s - 1] if s else None, bounds[s] if s < m.pp - 1 else None,
                                     self.mailbox, self.compute_dtype)
                         for s, st in enumerate(stages)]
                        for r, (stages, bounds) in enumerate(zip(self.replicas, self.replica_boundaries))]
        self.groups = [InProcessGroup(m.dp, self.meter, "dp") for _ in range(m.pp)]  # one DP group per stage
        d = cfg.dp
        compress = d.kind == "powersgd" or (d.kind in ("diloco", "streaming-diloco") and d.rank > 0 and not d.quantize)
        self.psgd = [[PowerSGDState(rank=d.rank or 4, start_step=d.start_step if d.kind == "powersgd" else 0,
                                    seed=t.seed * 7 + s) for s in range(m.pp)] for _ in range(m.dp)] if compress else None
        self.diloco = ([[DiLoCoState(st.named_parameters(), d.outer_lr, d.outer_momentum) for st in stages]
                        for stages in self.replicas] if d.kind == "diloco" else None)
        self.streaming = ([[StreamingState(st.named_parameters(), d.fragments, d.outer_lr, d.outer_momentum)
                            for st in stages] for stages in self.replicas] if d.kind == "streaming-diloco" else None)
        # Posted fragment syncs: (apply step, fragment, stage, deltas per replica, InFlight)
        self.in_flight: list[tuple[int, int, int, list[dict], InFlight]] = []
        self.tied = [tied_pair(stages) if cfg.model.tied == "sync" else None for stages in self.replicas]
        self.optimizers = [[self._optimizer(st, s) for s, st in enumerate(stages)] for stages in self.replicas]
        self.anchor = (SimAnchorCircuit(model, cfg, self.mailbox, self.meter, wire, self.compute_dtype,
                                        replica_tag=m.dp) if m.anchor else None)
        self.priors_consumed = 0
        self.last_diagnostics: dict | None = None
        self.schedule = serial_order(SCHEDULES[t.schedule](m.pp, t.microbatches))
        self.step_index = 0
        self.last_grad_norm = 0.0

    def _optimizer(self, stage: Stage, index: int):
        return build_stage_optimizer(stage, self.cfg, index)

    # boundary parameters ------------------------------------------------------------------------
    def sync_boundary_grads(self) -> None:
        """Receivers return their gradient contributions to shared boundary parameters (MAPL's A_p)
        to the owners, before DP sync and clipping see the gradients."""
        for r, bounds in enumerate(self.replica_boundaries):
            for b in bounds:
                payload = b.receiver_param_grads()
                if payload is not None:
                    self.mailbox.send((r, "dparams", b.index), payload, "pp_params")
                    b.owner_absorb_grads(self.mailbox.recv((r, "dparams", b.index)))

    def sync_boundary_params(self) -> None:
        """Owners send the updated shared boundary parameters to the other end."""
        for r, bounds in enumerate(self.replica_boundaries):
            for b in bounds:
                payload = b.owner_params()
                if payload is not None:
                    self.mailbox.send((r, "params", b.index), payload, "pp_params")
                    b.receiver_load_params(self.mailbox.recv((r, "params", b.index)))

    @torch.no_grad()
    def boundary_residuals(self, batches: list[dict], replica: int = 0) -> list[torch.Tensor]:
        """Per boundary, the sender's activation minus its token offset, (tokens, d), on ``batches``
        run through the model as it trains (through architectural boundaries, dense otherwise).
        The offset is the boundary's own (MAPL anchor / SSN fixed embedding), else the token
        embedding (MAPL Fig. 3's X - E[ids])."""
        stages, bounds = self.replicas[replica], self.replica_boundaries[replica]
        out = [[] for _ in bounds]
        for batch in batches:
            ctx = make_contexts(batch, 1, self.step_index, replica)[0]
            x = ctx.input_ids
            for s, st in enumerate(stages[:-1]):
                x = st(x, ctx)
                b = bounds[s]
                off = self._offset(b, stages, ctx)
                out[s].append((x - off).reshape(-1, x.shape[-1]).float())
                if b.architectural:
                    _, payload = sender_forward(b, x, ctx)
                    _, x = receiver_forward(b, payload, ctx, torch.float32)
        return [torch.cat(o) for o in out]

    @staticmethod
    def _offset(b, stages, ctx) -> torch.Tensor:
        if getattr(b, "sender_offset", None) is not None:
            off = b.sender_offset(ctx.input_ids)
            return 0.0 if off is None else off
        if getattr(b, "token_fixed", None) is not None:
            return b.token_fixed[ctx.input_ids]
        return stages[0].embed_tokens(ctx.input_ids)

    @torch.no_grad()
    def pca_start(self, batches: list[dict]) -> None:
        """Data-driven MAPL start: boundary by boundary, A_p = the top-r right singular vectors of
        the residuals it will see (the earlier boundaries already using their PCA projectors)."""
        stages, bounds = self.replicas[0], self.replica_boundaries[0]
        for p, b in enumerate(bounds):
            res = self.boundary_residuals(batches)[p]           # recomputed: upstream projectors changed
            _, _, Vh = torch.linalg.svd(res.double(), full_matrices=False)
            A = Vh[:b.rank].T.to(b.projector.A.dtype)
            for replica in self.replica_boundaries:
                replica[p].projector.A.copy_(A)
                replica[p].receiver_load_params(replica[p].owner_params() or Payload({"A": A}))

    def confine_all(self) -> None:
        for stages, bounds in zip(self.replicas, self.replica_boundaries):
            confine(stages, bounds[0].basis.U, bounds[0].token_fixed)

    def ssn_refresh_due(self) -> bool:
        every = self.cfg.boundary.ssn_refresh_every
        return self.ssn and every > 0 and (self.step_index + 1) % every == 0

    def ssn_refresh(self) -> None:
        """Grassmann step of the shared basis on this step's dL/dU (DP-averaged), then re-confine."""
        m, b = self.cfg.mesh, self.cfg.boundary
        bases = [bounds[0].basis for bounds in self.replica_boundaries]
        grads = [{"U": basis.U.grad if basis.U.grad is not None else torch.zeros_like(basis.U)} for basis in bases]
        if m.dp > 1:
            drive_lockstep(allreduce_average(g, self.groups[0], r, m.dp) for r, g in enumerate(grads))
        for basis, g in zip(bases, grads):
            with torch.no_grad():
                basis.U = grassmann_step(basis.U.detach(), g["U"], b.ssn_refresh_lr)
        # every other stage sends its contribution up and receives the new basis (d x k fp32 each)
        U = bases[0].U
        self.meter.add("pp_params", 2 * (m.pp - 1) * U.numel() * 4)
        self.confine_all()

    # ------------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        return t.lr * cosine_with_warmup(step, t.steps, t.warmup_ratio, t.min_lr_ratio)

    @torch.enable_grad()
    def forward_backward(self, batches: list[dict]) -> float:
        """Run every replica's pipeline on its batch; leaves gradients in the stages. Returns the
        mean over replicas of the (token-mean) training loss."""
        losses = []
        for r, batch in enumerate(batches):
            ctxs = make_contexts(batch, self.cfg.train.microbatches, self.step_index, r)
            workers = self.workers[r]
            last = workers[-1]
            last.losses.clear()
            for s, (kind, mb) in self.schedule:
                (workers[s].forward if kind == "F" else workers[s].backward)(ctxs[mb])
            losses.append(sum(last.losses))
        return sum(losses) / len(losses)

    def _grad_average(self, r: int, s: int):
        grads = {n: p.grad for n, p in self.replicas[r][s].named_parameters() if p.grad is not None}
        if self.cfg.dp.kind == "powersgd":
            return powersgd_average(self.psgd[r][s], grads, self.groups[s], r, self.cfg.mesh.dp)
        return allreduce_average(grads, self.groups[s], r, self.cfg.mesh.dp)

    def sync_gradients(self) -> None:
        """Per-step DP gradient sync per stage (every replica posts, then all finish; DiLoCo has
        none: it syncs weights every H steps), then the tied-embedding sync."""
        m = self.cfg.mesh
        if self.cfg.dp.kind in ("allreduce", "powersgd") and m.dp > 1:
            for s in range(m.pp):
                drive_lockstep(self._grad_average(r, s) for r in range(m.dp))
        for r in range(m.dp):
            pair = self.tied[r]
            if pair is not None:       # the two ends exchange their gradients and both apply the sum
                a, b = pair
                total = a.grad + b.grad
                a.grad.copy_(total)
                b.grad.copy_(total)
                if r == 0:
                    self.meter.add("tied", 2 * a.grad.numel() * a.grad.element_size())

    def optimizer_step(self) -> None:
        """Clip, fold in the anchor priors due now, correct, step; then advance the step counter."""
        priors = self.anchor.due(self.step_index) if self.anchor is not None else []
        self.priors_consumed += len(priors)
        lr = self.lr_at(self.step_index)
        for r in range(self.cfg.mesh.dp):
            stages = self.replicas[r]
            norms = torch.cat([tensor_norms(st.parameters()) for st in stages])
            total_norm, coef = clip_coefficient(norms, self.cfg.train.grad_clip)
            for s, (st, opt) in enumerate(zip(stages, self.optimizers[r])):
                if coef < 1.0:
                    for p in st.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
                for prior in priors:
                    opt.receive_prior(prior.grads[s])
                    if self.cfg.anchor.mix:
                        self._mix_anchor(st, prior.grads[s])
                for g in opt.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if r == 0:
                self.last_grad_norm = total_norm
        if self.diloco is not None and (self.step_index + 1) % self.cfg.dp.inner_steps == 0:
            self.diloco_outer_step()
        if self.streaming is not None:
            self.streaming_step()
        self.step_index += 1

    def streaming_step(self) -> None:
        """Post the fragments whose sync starts now; apply those posted ``overlap`` steps ago."""
        m, d, t = self.cfg.mesh, self.cfg.dp, self.step_index
        for f in sync_start_steps(t, d.inner_steps, d.fragments):
            for s in range(m.pp):
                deltas = [fragment_deltas(self.streaming[r][s], f, self.replicas[r][s].named_parameters())
                          for r in range(m.dp)]
                self.in_flight.append((t + d.overlap, f, s, deltas, self._post_fragment(f, s, deltas)))
        due = [x for x in self.in_flight if x[0] <= t]
        self.in_flight = [x for x in self.in_flight if x[0] > t]
        for *_, flight in due:
            flight.finish()

    def _post_fragment(self, f: int, s: int, deltas: list[dict]) -> InFlight:
        m, d = self.cfg.mesh, self.cfg.dp
        return InFlight(fragment_sync(self.streaming[r][s], f, deltas[r], self.replicas[r][s].named_parameters(),
                                      self.groups[s], r, m.dp, d.alpha, d.quantize,
                                      self.psgd[r][s] if self.psgd else None) for r in range(m.dp))

    def diloco_outer_step(self) -> None:
        m = self.cfg.mesh
        for s in range(m.pp):
            drive_lockstep(outer_step(self.diloco[r][s], self.replicas[r][s].named_parameters(), self.groups[s], r,
                                      m.dp, self.psgd[r][s] if self.psgd else None) for r in range(m.dp))

    @torch.no_grad()
    def _mix_anchor(self, stage: Stage, grads: dict[str, torch.Tensor]) -> None:
        """Variant ``anchor.mix``: add the stale anchor gradient itself, as asynchronous SGD would."""
        for name, p in stage.named_parameters():
            if name in grads and p.grad is not None:
                p.grad.add_(grads[name], alpha=self.cfg.anchor.mix)

    def run_anchor(self, anchor_batch: dict | None) -> None:
        if self.anchor is not None and self.anchor.starts_at(self.step_index):
            if anchor_batch is None:
                raise ValueError("the anchor circuit starts a cycle at this step but got no batch")
            self.anchor.run_cycle(self.step_index, self.replicas[0], anchor_batch, self.cfg.mesh.dp)

    def train_step(self, batches: list[dict], anchor_batch: dict | None = None) -> float:
        refresh = self.ssn_refresh_due()
        if refresh:
            for bounds in self.replica_boundaries:
                bounds[0].basis.U.requires_grad_(True)
        loss = self.forward_backward(batches)
        self.sync_boundary_grads()
        every = self.cfg.diag.every
        self.last_diagnostics = (gradient_diagnostics(self, batches[0])
                                 if every and self.step_index % every == 0 else None)
        self.run_anchor(anchor_batch)      # snapshot w_t: the weights this step's forward used
        self.sync_gradients()
        self.optimizer_step()
        self.sync_boundary_params()
        if self.ssn:
            if refresh:
                self.ssn_refresh()
            else:
                self.confine_all()
        return loss

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: dict, replica: int = 0) -> tuple[float, int]:
        """Unmasked, dense held-out loss of one replica: (sum of token losses, token count)."""
        ctx = make_contexts(batch, 1, self.step_index, replica)[0]
        n = int((batch["labels"][:, 1:] != -100).sum())
        ctx.loss_scale = 1.0
        x = ctx.input_ids
        for s, st in enumerate(self.replicas[replica]):
            if s and self.boundaries[s - 1].architectural:  # part of the model: evaluate through it
                b = self.replica_boundaries[replica][s - 1]
                _, payload = sender_forward(b, x, ctx)
                _, x = receiver_forward(b, payload, ctx, torch.float32)
            with torch.autocast("cpu", dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
                x = st(x, ctx)
        return float(x), n

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, replica: int = 0) -> torch.Tensor:
        """Vocabulary logits (B, T, V) of replica ``replica``'s model, through architectural
        boundaries (dense otherwise); ``attention_mask`` (B, T) marks real tokens with 1."""
        from thinpipe.engine.context import MicrobatchContext, positions_and_mask

        seg = torch.where(attention_mask.bool(), 0, -1)
        pos, mask = positions_and_mask(seg)
        ctx = MicrobatchContext(self.step_index, 0, replica, input_ids, torch.full_like(input_ids, -100), pos, mask, 1.0)
        x = input_ids
        stages = self.replicas[replica]
        for s, st in enumerate(stages):
            if s and self.boundaries[s - 1].architectural:
                b = self.replica_boundaries[replica][s - 1]
                _, payload = sender_forward(b, x, ctx)
                _, x = receiver_forward(b, payload, ctx, torch.float32)
            with torch.autocast("cpu", dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
                x = st.hidden_states(x, ctx)
        return stages[-1].logits(x).float()

    def state_dict(self) -> dict:
        return {"step": self.step_index,
                "stages": [[st.state_dict() for st in stages] for stages in self.replicas],
                "optimizers": [[o.state_dict() for o in opts] for opts in self.optimizers],
                "bytes": self.meter.snapshot(), "priors_consumed": self.priors_consumed,
                "psgd": [[st.state_dict() for st in row] for row in self.psgd] if self.psgd else None,
                "diloco": [[st.state_dict() for st in row] for row in self.diloco] if self.diloco else None,
                "streaming": [[st.state_dict() for st in row] for row in self.streaming] if self.streaming else None,
                # a posted sync is saved as its inputs (the collective is re-posted on load)
                "in_flight": [(due, f, s, deltas) for due, f, s, deltas, _ in self.in_flight],
                "anchor": self.anchor.state_dict() if self.anchor is not None else None,
                # boundary state beyond the stages' parameters (codebooks, the SSN basis, copies)
                "boundaries": [[b.state_dict() for b in bounds] for bounds in self.replica_boundaries]}

    def load_state_dict(self, state: dict) -> None:
        self.step_index = state["step"]
        for stages, sds in zip(self.replicas, state["stages"]):
            for st, sd in zip(stages, sds):
                st.load_state_dict(sd)
        for opts, sds in zip(self.optimizers, state["optimizers"]):
            for o, sd in zip(opts, sds):
                o.load_state_dict(sd)
        self.meter.totals.update(state["bytes"])
        self.priors_consumed = state["priors_consumed"]
        for rows, saved in ((self.psgd, state.get("psgd")), (self.diloco, state.get("diloco")),
                            (self.streaming, state.get("streaming"))):
            for row, srow in zip(rows or [], saved or []):
                for st, sd in zip(row, srow):
                    st.load_state_dict(sd)
        if self.anchor is not None:
            self.anchor.load_state_dict(state["anchor"])
        for bounds, saved in zip(self.replica_boundaries, state.get("boundaries") or []):
            for b, sd in zip(bounds, saved):
                b.load_state_dict(sd)
                payload = b.owner_params()       # the receiver's copy equals the restored owner's
                if payload is not None:
                    b.receiver_load_params(payload)
        before = self.meter.snapshot()  # re-posting must not count the bytes twice
        self.in_flight = [(due, f, s, deltas, self._post_fragment(f, s, deltas))
                          for due, f, s, deltas in state.get("in_flight", [])]
        self.meter.totals.update(before)
