"""The mesh as real processes on torch.distributed (gloo; the stages compute on CPU today).

Launched by torchrun (``torchrun --nproc-per-node N -m thinpipe train --engine dist ...`` or
``thinpipe launch``): every process derives the same ``MeshLayout`` from the config, builds the
model, keeps its own stage and the boundaries it touches, and runs one ``StageRank`` (the same
object the simulation runs, DESIGN.md property 1) with a ``DistTransport`` for payloads and
``DistGroup`` collectives for its stage's DP group and its replica's PP control group. Each
rank runs its own row of the pipeline schedule; then the step's phases, waiting on each Work.

Implemented here: dp x pp fast replicas, every boundary kind, every DP kind, both schedules, the
anchor circuit as its own row of processes (``anchor/ranks.py``: pulls, unmasked passes, pushes,
off the fast circuit's critical path), the held-out loss through the pipeline, metered bytes
summed over ranks, per-rank checkpoints at the end and every ``train.checkpoint_every`` steps,
``--resume`` (not yet with an anchor), the MAPL PCA start, SSN basis refreshes. Not yet (use the
simulation): gradient diagnostics.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from thinpipe.anchor.ranks import AnchorFeed, AnchorStageRank
from thinpipe.boundary import Boundary, build_boundaries
from thinpipe.boundary.base import Payload
from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.boundary.ssn import confine
from thinpipe.comm import AXES, ByteMeter
from thinpipe.comm.dist import DistTransport
from thinpipe.comm.distgroup import DistGroup
from thinpipe.comm.shaped import ShapedLink
from thinpipe.config import Config, ConfigError
from thinpipe.engine.context import make_contexts
from thinpipe.engine.rank import StageRank
from thinpipe.engine.log import say
from thinpipe.engine.schedule import SCHEDULES
from thinpipe.engine.sim import DTYPES, wire_dtype
from thinpipe.engine.worker import StageWorker
from thinpipe.mesh import MeshLayout
from thinpipe.optim import cosine_with_warmup

CHANNELS = {"F": 1, "B": 2, "dparams": 3, "params": 4, "tied": 5, "E": 6, "anchor-cycle": 7, "pull": 8, "push": 9,
            "ssn-g": 10, "ssn-u": 11}
# Anchor links wait as long as an anchor cycle may take, not the fast circuit's collective timeout.
ANCHOR_TIMEOUT_S = 24 * 3600


def check_supported(cfg: Config, resume: bool = False) -> None:
    if cfg.mesh.anchor and resume:
        raise ConfigError("--engine dist cannot resume a run with an anchor circuit yet (its priors in flight are "
                          "not checkpointed): start it again, or resume it in the simulation")
    if cfg.diag.every:
        raise ConfigError("--engine dist does not compute gradient diagnostics: set diag.every = 0")


def router(layout: MeshLayout, me: int):
    """A tag's peer: the other end of the link it names (boundary b: stages b and b+1; tied: first
    and last stage), in the tag's replica row; ("anchor-cycle", b): anchor stages b and b+1."""
    def route(tag) -> int:
        if tag[0] == "anchor-cycle":
            a, b = layout.grid[layout.dp][tag[1]], layout.grid[layout.dp][tag[1] + 1]
            return b if me == a else a
        row, kind = tag[0], tag[1]
        a, b = ((layout.grid[row][0], layout.grid[row][-1]) if kind == "tied"
                else (layout.grid[row][tag[2]], layout.grid[row][tag[2] + 1]))
        return b if me == a else a
    return route


def channel(tag) -> int:
    return CHANNELS[tag[0] if isinstance(tag[0], str) else tag[1]]


def anchor_router(layout: MeshLayout, stage: int, me: int):
    """Pull and push links of ``stage``: ("pull",) joins fast replica 0 and the anchor stage rank,
    ("push", r) the anchor stage rank and fast replica r."""
    anchor = layout.grid[layout.dp][stage]

    def route(tag) -> int:
        if me != anchor:
            return anchor
        return layout.grid[0][stage] if tag[0] == "pull" else layout.grid[tag[1]][stage]
    return route


class DistRun:
    def __init__(self, cfg: Config):
        from thinpipe.data import batches
        from thinpipe.engine.trainer import build_data
        from thinpipe.models import build_stages, load_model
        from thinpipe.models.lora import apply_lora

        self.cfg = cfg
        t, m = cfg.train, cfg.mesh
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.layout = MeshLayout(m.dp, m.pp, m.anchor)
        self.layout.check_world(world)
        self.role = self.layout.role(self.rank)
        torch.manual_seed(t.seed)
        loaded = load_model(cfg.model.name, seed=t.seed)
        apply_lora(loaded.model, t.lora)
        self.tokenizer = loaded.tokenizer
        self.train_ds, self.val_ds = build_data(cfg, loaded.tokenizer)
        stages = build_stages(loaded.model, m.split or None, m.pp)
        wire = wire_dtype(cfg)
        self.bounds = build_boundaries(cfg.boundary, m.pp, loaded.model.config.hidden_size, t.seed, wire, loaded.model)
        for b in self.bounds:
            b.attach(stages[b.index], stages[b.index + 1])
        if cfg.boundary.kind == "ssn" and m.pp > 1:
            confine(stages, self.bounds[0].basis.U, self.bounds[0].token_fixed)
        s = self.role.stage
        self.stage = stages[s]
        self.meter = ByteMeter()
        # Every process creates every group, in the same order (torch.distributed requires it).
        dp_groups = [dist.new_group(self.layout.dp_ranks(x)) for x in range(m.pp)]
        pp_groups = [dist.new_group(self.layout.pp_ranks(r)) for r in range(self.layout.rows)]
        # The fast circuit's own collectives (losses, held-out loss, checkpoints): never the anchor's.
        self.fast_group = dist.new_group([r for row in range(m.dp) for r in self.layout.grid[row]])
        if m.anchor:
            long = datetime.timedelta(seconds=ANCHOR_TIMEOUT_S)
            grid = self.layout.grid
            pull_groups = [dist.new_group([grid[0][x], grid[m.dp][x]], timeout=long) for x in range(m.pp)]
            push_groups = [dist.new_group([grid[r][x] for r in range(m.dp)] + [grid[m.dp][x]], timeout=long)
                           for x in range(m.pp)]
            row_group = dist.new_group(grid[m.dp], timeout=long)
        route = router(self.layout, self.rank)
        lk = cfg.link
        links: dict[int, ShapedLink] = {}

        # With kernel shaping (``thinpipe launch --netns``) tc enforces the rates; latency stays here.
        pp_mbps, dp_mbps = (0.0, 0.0) if lk.shaper == "kernel" else (lk.pp_mbps, lk.dp_mbps)

        def link_for(axis: str, peer: int) -> ShapedLink | None:
            # one outgoing link per peer, shared by everything this rank sends it (PP axes)
            if axis in ("pp_fwd", "pp_bwd", "pp_params", "tied") and (pp_mbps or lk.pp_latency_ms):
                return links.setdefault(peer, ShapedLink(pp_mbps, lk.pp_latency_ms))
            return None

        self.compute_dtype = DTYPES[t.dtype]
        self.step_index = 0
        self.feed: AnchorFeed | None = None
        self.anchor_rank: AnchorStageRank | None = None
        self.transport = DistTransport(route, channel, self.meter, link_for)
        self.eval_transport = DistTransport(route, channel, ByteMeter())  # evaluation traffic is not training's
        self.actions = SCHEDULES[t.schedule](m.pp, t.microbatches)[s]
        if m.anchor:
            # Pull and push cross between rows (the DP network): shaped like DP links.
            anchor_links: dict[int, ShapedLink] = {}

            def anchor_link_for(axis: str, peer: int) -> ShapedLink | None:
                if dp_mbps or lk.dp_latency_ms:
                    return anchor_links.setdefault(peer, ShapedLink(dp_mbps, lk.dp_latency_ms))
                return None

            aroute = anchor_router(self.layout, s, self.rank)
            pull = DistTransport(aroute, channel, self.meter, anchor_link_for, group=pull_groups[s], background=True)
            push = DistTransport(aroute, channel, self.meter, anchor_link_for, group=push_groups[s])
        if self.role.circuit == "anchor":
            # Dense boundaries, PP traffic on the anchor axis, as the simulation's anchor replica.
            dense = [Boundary(b, loaded.model.config.hidden_size, wire) for b in range(m.pp - 1)]
            row = DistTransport(route, channel, self.meter, lambda axis, peer: link_for("pp_fwd", peer),
                                group=row_group)  # the anchor row's PP links are shaped like the fast rows'

            worker = StageWorker(self.stage, m.dp, dense[s - 1] if s else None, dense[s] if s < m.pp - 1 else None,
                                 row, self.compute_dtype, axes=("anchor", "anchor"))
            data = batches(self.train_ds, t.batch_size, t.seed, shard=m.dp, num_shards=m.dp + m.anchor)
            self.anchor_rank = AnchorStageRank(cfg, self.stage, worker, self.actions, self.layout, pull, push, row,
                                               self.meter, wire, data)
            return
        self.in_b = self.bounds[s - 1] if s else None
        self.out_b = self.bounds[s] if s < m.pp - 1 else None
        self.rk = StageRank(cfg, self.stage, self.role.replica, self.in_b, self.out_b, self.transport,
                            DistGroup(dp_groups[s], m.dp, self.meter, "dp", dp_mbps, lk.dp_latency_ms),
                            DistGroup(pp_groups[self.role.replica], m.pp, self.meter, None), self.compute_dtype)
        if m.anchor:
            control = DistGroup(dp_groups[s], m.dp, self.meter, None)

            def agree(count: int) -> int:
                # ``arrival``: every replica of this stage takes the same priors at the same step.
                _, counts = control.all_gather(self.role.replica, torch.tensor([count]))
                return int(min(c.item() for c in counts))

            timeout_s = float(os.environ.get("THINPIPE_DIST_TIMEOUT_S", "60"))
            self.feed = AnchorFeed(cfg, self.stage, self.role.replica, pull, push, self.meter, wire, agree,
                                   wait_timeout_s=max(timeout_s, 600.0))

    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        return t.lr * cosine_with_warmup(step, t.steps, t.warmup_ratio, t.min_lr_ratio)

    def train_step(self, batch: dict) -> float:
        """This rank's share of one step; returns the step's training loss (mean over replicas), as
        the simulation reports it."""
        t = self.cfg.train
        refresh = self.ssn_refresh_due()
        if refresh:
            self.bounds[0].basis.U.requires_grad_(True)
        if self.feed is not None:
            self.feed.maybe_pull(self.step_index)  # w_t: the weights this step's forward uses
        ctxs = make_contexts(batch, t.microbatches, self.step_index, self.role.replica)
        worker = self.rk.worker
        worker.losses.clear()
        with torch.enable_grad():
            for kind, mb in self.actions:
                (worker.forward if kind == "F" else worker.backward)(ctxs[mb])
        lr = self.lr_at(self.step_index)
        priors = self.feed.due(self.step_index) if self.feed is not None else []
        for phase in (self.rk.exchange_boundary_grads(), self.rk.dp_sync(), self.rk.tied_sync(),
                      self.rk.clip_and_step(lr, priors, self.cfg.anchor.mix), self.rk.outer_steps(self.step_index),
                      self.rk.broadcast_boundary_params()):
            for work in phase:
                work.wait()
        self.transport.flush()
        if refresh:
            self.ssn_refresh()
        elif self.cfg.boundary.kind == "ssn" and self.cfg.mesh.pp > 1:
            confine([self.stage], self.bounds[0].basis.U, self.bounds[0].token_fixed)
        self.step_index += 1
        mine = sum(worker.losses) if self.stage.is_last else None
        gathered: list = [None] * self.layout.dp * self.layout.pp
        dist.all_gather_object(gathered, mine, group=self.fast_group)
        per_replica = [gathered[self.layout.grid[r][-1]] for r in range(self.cfg.mesh.dp)]
        return sum(per_replica) / len(per_replica)

    def ssn_refresh_due(self) -> bool:
        every, b = self.cfg.boundary.ssn_refresh_every, self.cfg.boundary
        return b.kind == "ssn" and self.cfg.mesh.pp > 1 and every > 0 and (self.step_index + 1) % every == 0

    def ssn_refresh(self) -> None:
        """SimMesh.ssn_refresh across ranks: each replica sums its stages' dL/dU up the pipeline
        (stage s adds its own to what stage s+1 sent), stage 0 averages over the DP group and takes
        the Grassmann step, the new basis goes back down; every stage re-confines. The bytes are the
        simulation's (2 (pp-1) messages of U per replica); the sum's order is not autograd's, so
        the result agrees to rounding, not bitwise."""
        from thinpipe.dp import allreduce_average
        from thinpipe.optim.stiefel import grassmann_step

        m, b = self.cfg.mesh, self.cfg.boundary
        basis, s, row = self.bounds[0].basis, self.role.stage, self.role.replica
        g = basis.U.grad.detach().clone() if basis.U.grad is not None else torch.zeros_like(basis.U)
        if s < m.pp - 1:
            g = g + self.transport.recv((row, "ssn-g", s)).tensors["g"]
        if s > 0:
            self.transport.send((row, "ssn-g", s - 1), Payload({"g": g}), "pp_params")
            U = self.transport.recv((row, "ssn-u", s - 1)).tensors["U"]
        else:
            grads = {"U": g}
            for work in allreduce_average(grads, self.rk.dp_group, row, m.dp) if m.dp > 1 else ():
                work.wait()
            with torch.no_grad():
                U = grassmann_step(basis.U.detach(), grads["U"], b.ssn_refresh_lr)
        if s < m.pp - 1:
            self.transport.send((row, "ssn-u", s), Payload({"U": U}), "pp_params")
        self.transport.flush()
        basis.U = U
        confine([self.stage], U, self.bounds[0].token_fixed)

    @torch.no_grad()
    def pca_start(self, batches: list[dict]) -> None:
        """SimMesh.pca_start across ranks: boundary by boundary, replica 0's stages run the batches
        up to the boundary's sender (through the earlier boundaries, already PCA-started), which
        takes the top-r right singular vectors of its residuals; every rank that holds the
        boundary loads them (a broadcast over the fast ranks; not metered, as in the simulation)."""
        m, s, row = self.cfg.mesh, self.role.stage, self.role.replica
        for p in range(m.pp - 1):
            A = None
            if row == 0 and s <= p:
                residuals = []
                for i, batch in enumerate(batches):
                    ctx = make_contexts(batch, 1, self.step_index, 0)[0]
                    tag = ("pca", p, i)
                    x = (ctx.input_ids if s == 0 else
                         receiver_forward(self.in_b, self.eval_transport.recv((0, "E", s - 1, tag)), ctx,
                                          torch.float32)[1])
                    x = self.stage(x, ctx)
                    if s < p:
                        self.eval_transport.send((0, "E", s, tag), sender_forward(self.out_b, x, ctx)[1], "pp_fwd")
                    else:
                        offset = getattr(self.out_b, "sender_offset", None)  # MAPL: embedding / anchor
                        off = offset(ctx.input_ids) if offset is not None else None
                        residuals.append((x - (0.0 if off is None else off)).reshape(-1, x.shape[-1]).float())
                self.eval_transport.flush()
                if s == p:
                    _, _, Vh = torch.linalg.svd(torch.cat(residuals).double(), full_matrices=False)
                    A = Vh[:self.out_b.rank].T
            box = [A]
            dist.broadcast_object_list(box, src=self.layout.grid[0][p], group=self.fast_group)
            for b in (self.in_b, self.out_b):
                if b is not None and b.index == p:
                    A = box[0].to(b.projector.A.dtype)
                    b.projector.A.copy_(A)
                    b.receiver_load_params(b.owner_params() or Payload({"A": A}))

    @torch.no_grad()
    def validation_loss(self, batch_size: int) -> float:
        """Replica 0's held-out loss, through its pipeline: dense boundaries unless the boundary is
        part of the model (as the simulation evaluates)."""
        val, total, n = self.val_ds, 0.0, 0
        if self.role.replica == 0:
            for i in range(0, len(val), batch_size):
                batch = {"input_ids": val.input_ids[i:i + batch_size], "labels": val.labels[i:i + batch_size],
                         "segment_ids": val.segment_ids[i:i + batch_size]}
                ctx = make_contexts(batch, 1, self.step_index, 0)[0]
                ctx.loss_scale = 1.0
                tag = i // batch_size
                if self.stage.is_first:
                    x = ctx.input_ids
                else:
                    b = self._eval_boundary(self.in_b)
                    _, x = receiver_forward(b, self.eval_transport.recv((0, "E", b.index, tag)), ctx, torch.float32)
                with torch.autocast("cpu", dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
                    x = self.stage(x, ctx)
                if self.stage.is_last:
                    total += float(x)
                    n += int((batch["labels"][:, 1:] != -100).sum())
                else:
                    b = self._eval_boundary(self.out_b)
                    self.eval_transport.send((0, "E", b.index, tag), sender_forward(b, x, ctx)[1], "pp_fwd")
            self.eval_transport.flush()
        out: list = [None] * self.layout.dp * self.layout.pp
        dist.all_gather_object(out, (total, n) if (self.role.replica == 0 and self.stage.is_last) else None,
                               group=self.fast_group)
        total, n = out[self.layout.grid[0][-1]]
        return total / max(n, 1)

    @staticmethod
    def _eval_boundary(b):
        return b if b.architectural else Boundary(b.index, b.hidden_size, None)

    def save_checkpoint(self, folder: Path, val_points: list, metrics: list) -> None:
        """Every rank writes ``step{N}/rank{r}.pt`` atomically; once all have (barrier), rank 0 points
        ``latest.json`` at step N and removes older sets. A crash at any moment leaves
        ``latest.json`` naming a complete set."""
        import shutil

        from thinpipe.engine.trainer import _atomic_save

        step_dir = folder / f"step{self.step_index}"
        step_dir.mkdir(parents=True, exist_ok=True)
        _atomic_save({"step": self.step_index, "role": self.role.__dict__, "rank": self.rk.state_dict(),
                      "boundaries": {b.index: b.state_dict() for b in (self.in_b, self.out_b) if b is not None},
                      "bytes": self.meter.snapshot(), "val_points": val_points, "metrics": metrics},
                     step_dir / f"rank{self.rank}.pt")
        if os.environ.get("THINPIPE_FAULT_AT_CHECKPOINT") == str(self.step_index) and self.rank == dist.get_world_size() - 1:
            raise RuntimeError(f"THINPIPE_FAULT_AT_CHECKPOINT: injected fault while checkpointing step {self.step_index}")
        dist.barrier(group=self.fast_group)
        if self.rank == 0:
            tmp = folder / "latest.json.tmp"
            tmp.write_text(json.dumps({"step": self.step_index, "world_size": dist.get_world_size()}))
            os.replace(tmp, folder / "latest.json")
            for old in folder.glob("step*"):
                if old.is_dir() and old != step_dir:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=self.fast_group)

    def load_checkpoint(self, folder: Path) -> dict:
        marker = folder / "latest.json"
        if not marker.is_file():
            raise ConfigError(f"--resume: no complete checkpoint in {folder} (no latest.json); start without --resume")
        latest = json.loads(marker.read_text())
        if latest["world_size"] != dist.get_world_size():
            raise ConfigError(f"--resume: the checkpoint was written by {latest['world_size']} ranks, this job has "
                              f"{dist.get_world_size()}")
        state = torch.load(folder / f"step{latest['step']}" / f"rank{self.rank}.pt", weights_only=False)
        self.step_index = state["step"]
        for b in (self.in_b, self.out_b):
            if b is not None:
                b.load_state_dict(state["boundaries"][b.index])
        for work in self.rk.load_state_dict(state["rank"]):
            work.wait()
        # The receiver's copy of shared boundary parameters equals the owner's again (not metered:
        # a resume re-sync, not training traffic).
        if self.out_b is not None and self.out_b.has_shared_params:
            self.eval_transport.send((self.role.replica, "params", self.out_b.index), self.out_b.owner_params(), "pp_params")
        if self.in_b is not None and self.in_b.has_shared_params:
            self.in_b.receiver_load_params(self.eval_transport.recv((self.role.replica, "params", self.in_b.index)))
        self.eval_transport.flush()
        self.meter.totals.update(state["bytes"])
        return state

    def boundary_memory_bytes(self) -> int:
        """AQ-SGD's buffers (and any boundary state beyond parameters), every fast rank's ends."""
        mine = sum(b.memory_bytes() for b in (self.in_b, self.out_b) if b is not None)
        out: list = [None] * self.layout.dp * self.layout.pp
        dist.all_gather_object(out, mine, group=self.fast_group)
        return sum(out)

    def bytes_total(self) -> dict[str, int]:
        """Every rank's metered bytes, the anchor ranks' included (each reported them to its stage's
        fast ranks in its end message; replica 0 counts them once)."""
        mine = self.meter.snapshot()
        if self.feed is not None and self.role.replica == 0:
            mine = {a: mine[a] + self.feed.anchor_bytes[a] for a in AXES}
        out: list = [None] * self.layout.dp * self.layout.pp
        dist.all_gather_object(out, mine, group=self.fast_group)
        return {a: sum(o[a] for o in out) for a in AXES}


def feed_summary(feed: AnchorFeed | None) -> dict:
    """Rank 0's view of the anchor circuit: what the simulation reports, plus how long the fast
    circuit waited on the anchor (late priors, a pull that had not left), the pulls ``arrival``
    skipped because the last one was still on its way, and whether the anchor failed."""
    if feed is None:
        return {}
    seen = feed.staleness_seen
    return {"priors_consumed": len(seen), "anchor_staleness_mean": sum(seen) / len(seen) if seen else None,
            "anchor_staleness_max": max(seen) if seen else None, "anchor_delivery": feed.delivery,
            "anchor_wait_s": feed.wait_s, "anchor_failed": feed.anchor_failed,
            "anchor_pulls_skipped": feed.pulls_skipped}


def exit_with_launcher() -> None:
    """Exit this rank when its torchrun agent dies (SIGKILL, lost node): torchrun starts each rank in
    its own session, so nothing else would stop an orphaned rank, which would keep training and
    holding its machine. Only for ranks a launcher started (torchrun sets TORCHELASTIC_RUN_ID,
    ``thinpipe launch --netns`` sets THINPIPE_WATCH_PARENT=1)."""
    import threading

    if "TORCHELASTIC_RUN_ID" not in os.environ and os.environ.get("THINPIPE_WATCH_PARENT") != "1":
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        say(f"[thinpipe rank {os.environ.get('RANK', '?')}] its launcher (pid {parent}) is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="thinpipe-launcher-watch", daemon=True).start()


def train_dist(cfg: Config, out: str | Path, progress: bool = True, resume: bool = False) -> dict | None:
    """Run this process's rank of a distributed training run; rank 0 writes the run folder and
    returns the summary (other ranks return None). ``resume`` continues from the per-rank
    checkpoints in ``out/checkpoint`` (the same trajectory as an uninterrupted run)."""
    from thinpipe.data import batches
    from thinpipe.engine.trainer import plot_losses

    check_supported(cfg, resume)
    exit_with_launcher()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ConfigError("--engine dist must be started by torchrun (or `thinpipe launch --nproc N -- train ...`)")
        # A peer that dies leaves the others blocked in a receive or collective: they give up after
        # this many seconds with an error instead of hanging (torchrun tears a local job down sooner).
        timeout_s = float(os.environ.get("THINPIPE_DIST_TIMEOUT_S", "60"))
        # gloo even where CUDA exists: every engine keeps its tensors on the CPU so far, and NCCL
        # moves only CUDA tensors (GPU placement is future work, see docs/distributed.md).
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        run = DistRun(cfg)
        role = run.role
        say(f"[thinpipe rank {run.rank}/{dist.get_world_size()}] {role.circuit} replica {role.replica}, "
            f"stage {role.stage} (layers {run.stage.first_layer}-{run.stage.first_layer + len(run.stage.layers) - 1})")
        if run.anchor_rank is not None:
            # Off the critical path: cycles until the fast circuit stops it (see anchor/ranks.py).
            run.anchor_rank.run(fault_at_cycle=int(os.environ.get("THINPIPE_FAULT_ANCHOR_AT_CYCLE", "-1"))
                                if run.stage.is_last else -1)
            return None
        t = cfg.train
        out = Path(out)
        lead = run.rank == 0
        ckpt = out / "checkpoint"
        if lead:
            ckpt.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(cfg.to_toml())
        dist.barrier(group=run.fast_group)
        val_points, metrics, start = [], [], 0
        if resume:
            state = run.load_checkpoint(ckpt)
            start, val_points, metrics = state["step"], state["val_points"], state["metrics"]
        if cfg.boundary.init == "pca" and cfg.boundary.kind in ("mapl", "mapl-vq") and not resume:
            # The simulation's own stream for it (another seed): the training data order is unchanged.
            pca_stream = batches(run.train_ds, t.batch_size, t.seed + 1_000_003)
            run.pca_start([next(pca_stream) for _ in range(cfg.boundary.pca_batches)])
        stream = batches(run.train_ds, t.batch_size, t.seed, shard=run.role.replica,
                         num_shards=cfg.mesh.dp + cfg.mesh.anchor, start_step=start)
        if not val_points:
            val_points = [(0, run.validation_loss(t.batch_size))]
        tokens_per_step = t.batch_size * t.seq_len * cfg.mesh.dp
        fault_at = int(os.environ.get("THINPIPE_FAULT_AT_STEP", "-1"))  # crash-recovery tests only
        wall0 = time.perf_counter() - (metrics[-1]["wall_s"] if metrics else 0.0)
        for step in range(start, t.steps):
            if step == fault_at:
                raise RuntimeError(f"THINPIPE_FAULT_AT_STEP: injected fault at step {step}")
            loss = run.train_step(next(stream))
            if not math.isfinite(loss):
                raise RuntimeError(f"training diverged at step {step}: loss = {loss}")
            row = {"step": step, "loss": loss, "lr": run.lr_at(step), "tokens": (step + 1) * tokens_per_step,
                   "grad_norm": run.rk.last_grad_norm, "wall_s": time.perf_counter() - wall0}
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < t.steps:
                row["val_loss"] = run.validation_loss(t.batch_size)
                val_points.append((step + 1, row["val_loss"]))
            metrics.append(row)
            if lead and progress:
                say(f"[rank 0] step {step + 1}/{t.steps} loss {loss:.4f}")
            if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps:
                run.save_checkpoint(ckpt, val_points, metrics)
        wall = time.perf_counter() - wall0
        if run.feed is not None:
            run.feed.finish()
        final = run.validation_loss(t.batch_size)
        val_points.append((t.steps, final))
        totals = run.bytes_total()
        memory = run.boundary_memory_bytes()
        run.save_checkpoint(ckpt, val_points, metrics)
        if not lead:
            return None
        tokens = t.steps * tokens_per_step
        summary = {"engine": "dist", "world_size": dist.get_world_size(), "steps": t.steps, "tokens": tokens,
                   "initial_val_loss": val_points[0][1], "final_train_loss": metrics[-1]["loss"] if metrics else None,
                   "final_val_loss": final, "val_ppl": math.exp(final),
                   **{f"{a}_bytes": totals[a] for a in AXES},
                   "bytes_per_token": {a: totals[a] / tokens for a in AXES},
                   "header_bytes_rank0": run.transport.header_bytes, "boundary_memory_bytes": memory,
                   "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None, "val_points": val_points,
                   **feed_summary(run.feed)}
        with open(out / "metrics.jsonl", "w") as f:
            for m in metrics:
                f.write(json.dumps(m) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_losses(metrics, val_points, out / "loss.png",
                    f"{cfg.model.name}: dist {cfg.mesh.dp}x{cfg.mesh.pp} {cfg.boundary.kind}")
        return summary
    finally:
        if "run" in locals():
            run.transport.close()
            for tr in (run.feed.pull_transport, run.feed.push_transport) if run.feed else ():
                tr.close()
            a = run.anchor_rank
            for tr in (a.pull_transport, a.push_transport, a.row_transport) if a else ():
                tr.close()
        dist.destroy_process_group()
