"""Single-process simulation of the mesh: ``dp`` fast replicas x ``pp`` stages, exactly.

The mesh is a grid of ``StageRank`` objects (``rank/stage_rank.py``), one per (replica, stage): each
holds its stage, boundaries, optimizer and DP state, as a process of the real mesh does. Here
their transport is an in-process mailbox and their groups in-process collectives, both metered,
and every phase of a step runs on all ranks in lockstep: every replica's pipeline schedule ->
boundary-parameter gradients to their owners -> DP sync per stage -> tied-embedding sync ->
global-norm clip + optimizer step -> DiLoCo / Streaming DiLoCo outer work -> boundary parameters
to the other end -> a boundary stage state's refresh (``StageRank.phases``). With
``mesh.anchor = 1`` an anchor circuit runs an unmasked cycle on the step's weights every
``anchor.every`` steps, and the priors due at a step are folded into each stage's
spectral-correction optimizer just before it steps (§3.2, §3.4).

Every stage, boundary and the anchor's stages compute on one ``device`` (``thinpipe/placement.py``:
one object holds both ends of a boundary here, so the simulation does not split across GPUs).
"""

from __future__ import annotations

import torch

from thinpipe.anchor import SimAnchorCircuit
from thinpipe.boundary import build_boundaries
from thinpipe.boundary.link import through
from thinpipe.comm.inprocess import InProcessGroup, Mailbox, drive_lockstep
from thinpipe.comm.meter import ByteMeter
from thinpipe.config import Config
from thinpipe.engine.sim_diagnostics import gradient_diagnostics
from thinpipe.models.stages import Stage, build_stages
from thinpipe.objective.registry import anchor_contexts
from thinpipe.placement import autocast, compute_dtype_name, to_device
from thinpipe.rank.context import MicrobatchContext, make_contexts, positions_and_mask
from thinpipe.rank.from_config import DTYPES, configure_stage, lr_at, wire_dtype
from thinpipe.rank.passes import heldout_pass, residual_pass, residual_start_boundaries, start_copies
from thinpipe.rank.schedule import SCHEDULES, execute, serial_order
from thinpipe.rank.split_measure import simulated_split
from thinpipe.rank.stage_rank import StageRank

__all__ = ["DTYPES", "SimMesh", "wire_dtype"]


class SimMesh:
    def __init__(self, model, cfg: Config, device: torch.device = torch.device("cpu")):
        self.cfg, self.device = cfg, device
        t, m = cfg.train, cfg.mesh
        self.compute_dtype = DTYPES[compute_dtype_name(t.dtype, device)]
        on_wire = wire_dtype(cfg, device)
        self.meter = ByteMeter()
        self.mailbox = Mailbox(self.meter)
        hidden = model.config.hidden_size
        # mesh.split = "auto": chosen here from one measurement and mesh.speeds (rank/split_measure.py)
        self.split_auto = simulated_split(cfg, model.config, device) if m.split == "auto" else None
        # One boundary object per link and replica, holding both ends (in simulation both ends are
        # this process). Learned kinds register their parameters on the stage that owns them; the
        # other end computes with a copy that is synced over the wire (``sync_boundary_*``).
        self.replicas: list[list[Stage]] = [
            [configure_stage(st, cfg) for st in build_stages(model, m.fixed_split, m.pp)] for _ in range(m.dp)]
        self.replica_boundaries = [build_boundaries(cfg.boundary, m.pp, hidden, t.seed, on_wire, model)
                                   for _ in range(m.dp)]
        for stages, bounds in zip(self.replicas, self.replica_boundaries):
            for b in bounds:
                b.attach(stages[b.index], stages[b.index + 1])
            for module in [*stages, *bounds]:
                module.to(device)  # after attach: the owned boundary modules move with their stage
        self.boundaries = self.replica_boundaries[0]
        # One rank per (replica, stage), exactly what a process of the real mesh runs; the groups
        # and the mailbox are their in-process transport. Each stage has one DP group (metered on
        # ``dp``); each replica one PP control group (the clip's gradient norms, not metered).
        self.groups = [InProcessGroup(m.dp, self.meter, "dp") for _ in range(m.pp)]
        pp_groups = [InProcessGroup(m.pp, self.meter, None) for _ in range(m.dp)]
        self.ranks: list[list[StageRank]] = [
            [StageRank(cfg, st, r, bounds[s - 1] if s else None, bounds[s] if s < m.pp - 1 else None, self.mailbox,
                       self.groups[s], pp_groups[r], self.compute_dtype) for s, st in enumerate(stages)]
            for r, (stages, bounds) in enumerate(zip(self.replicas, self.replica_boundaries))]
        self.workers = [{rk.index: rk.worker for rk in row} for row in self.ranks]
        self.optimizers = [[rk.optimizer for rk in row] for row in self.ranks]
        self.anchor = (SimAnchorCircuit(model, cfg, self.mailbox, self.meter, on_wire, self.compute_dtype,
                                        replica_tag=m.dp) if m.anchor else None)
        if self.anchor is not None:
            for st in self.anchor.stages:
                st.to(device)
        self.priors_consumed = 0
        self.last_diagnostics: dict | None = None
        self.step_index = 0
        self.last_grad_norm = 0.0

    def all_ranks(self) -> list[StageRank]:
        return [rk for row in self.ranks for rk in row]

    def phase(self, make) -> None:
        """Run one step phase on every rank, in lockstep (see ``rank/stage_rank.py``)."""
        drive_lockstep(make(rk) for rk in self.all_ranks())

    @torch.no_grad()
    def boundary_residuals(self, batches: list[dict]) -> list[torch.Tensor]:
        """Per boundary, replica 0's (tokens, d) residuals on ``batches`` (``rank/passes.py: residual_pass``)."""
        out: dict[int, list[torch.Tensor]] = {}
        self._residual_phase(batches, set(range(len(self.boundaries))), out)
        return [torch.cat(out[b.index]) for b in self.boundaries]

    def _residual_phase(self, batches: list[dict], at: set[int], out: dict) -> None:
        batches = [to_device(b, self.device) for b in batches]
        embed = self.replicas[0][0].embed_tokens
        drive_lockstep(residual_pass(rk.stage, rk.in_boundary, rk.out_boundary, self.mailbox, batches, at,
                                     self.step_index, out, embed) for rk in self.ranks[0])

    @torch.no_grad()
    def residual_start(self, batches: list[dict]) -> None:
        """The residual start of the boundaries that want one (MAPL's PCA start): boundary by
        boundary, replica 0's sender computes it and every replica's copy loads it (metered on
        ``pp_params``: what a data-driven start sends is side information the run pays for)."""
        for p in residual_start_boundaries(self.boundaries):
            out: dict[int, list[torch.Tensor]] = {}
            self._residual_phase(batches, {p}, out)
            payload = self.boundaries[p].init_from_residuals(torch.cat(out[p]))
            for bounds in self.replica_boundaries:
                bounds[p].load_init(payload)
            # the owner's payload reaches every other copy: both ends of every replica but its own end
            self.meter.add("pp_params", payload.nbytes * start_copies(self.cfg.mesh.dp))

    @torch.enable_grad()
    def run_schedules(self, ctxs: dict[int, list[MicrobatchContext]]) -> float:
        """Every replica's pipeline schedule over its contexts; leaves gradients in the stages. Returns the sum
        over replicas of their summed microbatch losses."""
        total = 0.0
        for r, rows in ctxs.items():
            execute(serial_order(SCHEDULES[self.cfg.train.schedule](self.cfg.mesh.pp, len(rows))), self.workers[r],
                    rows)
            total += sum(self.workers[r][self.cfg.mesh.pp - 1].losses)
        return total

    def forward_backward(self, batches: list[dict]) -> float:
        """``run_schedules`` of one next-token batch per replica (tests); returns the mean over replicas of the
        (token-mean) training loss."""
        ctxs = {r: make_contexts(to_device(b, self.device), self.cfg.train.microbatches, self.step_index, r)
                for r, b in enumerate(batches)}
        return self.run_schedules(ctxs) / len(batches)

    def lr_at(self, step: int) -> float:
        return lr_at(self.cfg, step)

    def sync_boundary_grads(self) -> None:
        """Receivers return their gradient contributions to shared boundary parameters to the owners
        (the first phase of a step, alone: for tests that stop after the backward)."""
        self.phase(lambda rk: rk.exchange_boundary_grads())

    def sync_gradients(self) -> None:
        """The per-step gradient syncs alone (DP per stage, then the tied embedding), for tests."""
        self.phase(lambda rk: rk.dp_sync(self.step_index))
        self.phase(lambda rk: rk.tied_sync())

    def update(self, index: int, lr: float, ctxs: dict[int, list[MicrobatchContext]], source=None) -> float:
        """One update of every rank (``objective/pipe.py: Pipe.update``; the one place the simulation assembles
        one): every replica's schedule over its contexts, then the phases in lockstep with the priors due at
        ``index``; between the first phase (boundary-parameter gradients at their owners) and the optimizer
        step, the optional gradient diagnostic and, at a cycle's start, the anchor circuit's pass on the weights
        this update's forward used, of the rows ``source.anchor_rows`` gives (the objective's). Returns the sum
        over replicas of their summed microbatch losses."""
        for rk in self.all_ranks():
            rk.begin_step(index)
        total = self.run_schedules(ctxs)
        priors = self.anchor.due(index) if self.anchor is not None else []
        self.priors_consumed += len(priors)
        phases = [rk.phases(index, lr, [p.grads[rk.index] for p in priors], self.cfg.anchor.mix)
                  for rk in self.all_ranks()]
        drive_lockstep(ph[0] for ph in phases)        # boundary-parameter gradients reach their owners
        every = self.cfg.diag.every
        self.last_diagnostics = gradient_diagnostics(self, ctxs[0]) if every and index % every == 0 else None
        if self.anchor is not None and self.anchor.starts_at(index):  # snapshot w_t: this update's forward's weights
            rows = source.anchor_rows(index, ctxs)
            if not source.anchor_local:  # they travel with each stage's pull, as on the real mesh
                self.meter.add("anchor", sum(t.nbytes for t in rows.values()) * self.cfg.mesh.pp)
            self.anchor.run_cycle(index, self.replicas[0], anchor_contexts(self.cfg, rows, index,
                                                                           self.anchor.replica_tag, self.device),
                                  self.cfg.mesh.dp)
        for i in range(1, len(phases[0])):
            drive_lockstep(ph[i] for ph in phases)
        self.last_grad_norm = self.ranks[0][0].last_grad_norm
        return total

    def train_step(self, batches: list[dict], anchor_batch: dict | None = None) -> float:
        """One next-token step of every rank on one batch per replica (tests and benchmarks; a run's step is
        its objective's, through ``update``); returns the mean over replicas of the training loss."""
        ctxs = {r: make_contexts(to_device(b, self.device), self.cfg.train.microbatches, self.step_index, r)
                for r, b in enumerate(batches)}
        loss = self.update(self.step_index, self.lr_at(self.step_index), ctxs, _AnchorBatch(anchor_batch))
        loss /= len(batches)
        self.step_index += 1
        return loss

    # ------------------------------------------------------------------------------------------
    def eval_loss(self, batch: dict, replica: int = 0) -> tuple[float, int]:
        """Unmasked, dense held-out loss of one replica: (sum of token losses, token count), by the
        pass a real rank runs (``rank/passes.py: heldout_pass``) over the unmetered mailbox axis."""
        out: list[tuple[float, int]] = []
        drive_lockstep(heldout_pass(rk.stage, rk.in_boundary, rk.out_boundary, self.mailbox, [batch],
                                    self.compute_dtype, self.step_index, out, replica) for rk in self.ranks[replica])
        return out[0]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, replica: int = 0) -> torch.Tensor:
        """Vocabulary logits (B, T, V) of replica ``replica``'s model, through architectural
        boundaries (dense otherwise); ``attention_mask`` (B, T) marks real tokens with 1."""
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        seg = torch.where(attention_mask.bool(), 0, -1)
        pos, mask = positions_and_mask(seg)
        ctx = MicrobatchContext(self.step_index, 0, replica, input_ids, torch.full_like(input_ids, -100),
                                pos, mask, 1.0)
        x = input_ids
        stages = self.replicas[replica]
        for s, st in enumerate(stages):
            if s and self.boundaries[s - 1].architectural:
                b = self.replica_boundaries[replica][s - 1]
                x = through(b, x, ctx)
            with autocast(self.device, self.compute_dtype):
                x = st.hidden_states(x, ctx)
        return stages[-1].logits(x).float()

    def boundary_memory_bytes(self) -> int:
        """Boundary state beyond parameters (AQ-SGD's per-example buffers), every end of the mesh."""
        return sum(b.memory_bytes() for bounds in self.replica_boundaries for b in bounds)

    def state_dict(self) -> dict:
        return {"step": self.step_index,
                "ranks": [[rk.state_dict() for rk in row] for row in self.ranks],
                "bytes": self.meter.snapshot(), "priors_consumed": self.priors_consumed,
                "anchor": self.anchor.state_dict() if self.anchor is not None else None,
                # boundary state beyond the stages' parameters (codebooks, the SSN basis, copies)
                "boundaries": [[b.state_dict() for b in bounds] for bounds in self.replica_boundaries]}

    @staticmethod
    def _ranks_from_v1(state: dict) -> list[list[dict]]:
        """Checkpoints written before the per-rank layout (one list per kind of state) -> per rank."""
        def at(key, r, s):
            rows = state.get(key)
            return rows[r][s] if rows else None
        return [[{"stage": sd, "optimizer": state["optimizers"][r][s], "psgd": at("psgd", r, s),
                  "diloco": at("diloco", r, s), "streaming": at("streaming", r, s),
                  "in_flight": [(due, f, deltas[r]) for due, f, s2, deltas in state.get("in_flight", []) if s2 == s]}
                 for s, sd in enumerate(row)] for r, row in enumerate(state["stages"])]

    def load_state_dict(self, state: dict) -> None:
        if "ranks" not in state:
            state = {**state, "ranks": self._ranks_from_v1(state)}
        self.step_index = state["step"]
        self.priors_consumed = state["priors_consumed"]
        if self.anchor is not None and state["anchor"] is not None:  # None: a dist job's model (run_parts.py)
            self.anchor.load_state_dict(state["anchor"])
        for bounds, saved in zip(self.replica_boundaries, state.get("boundaries") or []):
            for b, sd in zip(bounds, saved):
                b.load_state_dict(sd)
        # Restoring re-posts in-flight syncs, which must not count their bytes twice.
        self.phase(lambda rk: rk.load_state_dict(state["ranks"][rk.replica][rk.index]))
        self.meter.totals.update(state["bytes"])
        for bounds in self.replica_boundaries:
            for b in bounds:
                payload = b.owner_params()       # the receiver's copy equals the restored owner's
                if payload is not None:
                    b.receiver_load_params(payload)


class _AnchorBatch:
    """``train_step``'s anchor rows: the batch a test hands it (the anchor's own shard)."""

    anchor_local = True

    def __init__(self, batch: dict | None):
        self.batch = batch

    def anchor_rows(self, index, ctxs):
        if self.batch is None:
            raise ValueError("the anchor circuit starts a cycle at this step but got no batch")
        return self.batch
