"""One rank of the mesh as a real process on torch.distributed (gloo on the wire; stages on CPU or CUDA).

Launched by torchrun (``torchrun --nproc-per-node N -m thinpipe train --engine dist ...`` or
``thinpipe launch``): every process derives the same ``MeshLayout`` and ``ProcessGroups`` from the
config, builds only its own stage (``setup.load_stage``: its weights alone are read) and the
boundaries, and runs one
``StageRank`` (the object the simulation runs: one code path, docs/architecture.md) with a ``DistTransport`` for
payloads and ``DistGroup`` collectives. A fast rank is an engine of the run loop (``engine/loop.py``: the
same loop, rows and summary as the simulation); an anchor rank runs its cycles (``anchor/dist_rank.py``)
until the fast circuit stops it. Everything ranks exchange after start-up is tensors (validated
payload headers, fixed-size collectives), never pickled objects. A rank computes on
``train.device`` (``cuda``: ``cuda:(LOCAL_RANK mod GPUs)``); what it sends is staged through host
memory (``comm/staging.py``). Every rank, the anchor's included, writes its own part of each
checkpoint set; ``--resume`` starts from the newest set every rank holds. Not yet (use the
simulation): gradient diagnostics.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from thinpipe.analysis import energy_vs_fixed
from thinpipe.anchor.dist_rank import AnchorStageRank
from thinpipe.anchor.dist_wiring import anchor_feed
from thinpipe.checkpoint import prune, save_part, step_dir
from thinpipe.comm.dist_group import DistGroup
from thinpipe.comm.dist_transport import DistTransport, broadcast_payload, job_wire
from thinpipe.comm.jobkey import job_key
from thinpipe.comm.meter import AXES, ByteMeter
from thinpipe.comm.orphan import exit_with_launcher
from thinpipe.comm.payload import Payload
from thinpipe.comm.rendezvous import init_gloo
from thinpipe.comm.tags import ModelShare, Params
from thinpipe.config import Config, ConfigError
from thinpipe.config.env import dist_timeout_s
from thinpipe.console import say
from thinpipe.engine.dist_pipe import DistPipe
from thinpipe.engine.dist_setup import (
    RankSetup,
    agreed_set,
    anchor_rank,
    check_supported,
    held_state,
)
from thinpipe.engine.job_model import (
    architectural_line,
    flat,
    flat_expect,
    model_share,
    model_summary,
    sent_bytes,
    skeleton,
    unflat,
    write_model,
)
from thinpipe.engine.loop import run
from thinpipe.engine.rank_rows import VECTOR, rank_vector, rows_of
from thinpipe.faults import fault_anchor_at_cycle, fault_at_checkpoint, fault_at_step, slow_factor
from thinpipe.models.heap import release_freed_heap
from thinpipe.objective.registry import make_objective
from thinpipe.rank.from_config import DTYPES, val_batches, wire_dtype
from thinpipe.rank.passes import residual_pass, residual_start_boundaries, start_copies
from thinpipe.rank.stage_rank import StageRank

PART_KEYS = ("step", "world_size", "role", "rank", "boundaries", "bytes", "anchor")  # a rank's part, the rest is extra


class DistEngine:
    """A fast rank of the real mesh, as an engine of the run loop (``engine/loop.py``)."""

    def __init__(self, r: RankSetup, data_replica: int | None = None, make_dp_group=None):
        """``data_replica``: the replica whose data shard and mask streams this rank uses (default its
        role's; an elastic replica's world numbers its only row 0); ``make_dp_group(meter)``: its
        stage's DP group (default the mesh's ``DistGroup``; an elastic replica's is torchft's,
        ``comm/managed.py``)."""
        cfg, m, s = r.cfg, r.cfg.mesh, r.role.stage
        self.data_replica = r.role.replica if data_replica is None else data_replica
        self.cfg, self.layout, self.role, self.groups = cfg, r.layout, r.role, r.groups
        self.stage, self.bounds, self.train_ds, self.val_ds = r.stage, r.bounds, r.train_ds, r.val_ds
        self.split_auto = r.split_auto
        self.rank, self.world_size, self.device = r.role.rank, r.layout.world_size, r.device
        self.lead = self.rank == 0
        self.meter = ByteMeter()
        wire = job_wire(cfg.wire.encrypt, "--engine dist")
        self.transport = DistTransport(self.layout, self.rank, self.meter, r.links.pp, device=r.device, label="pp",
                                       **wire)
        self.eval_transport = DistTransport(self.layout, self.rank, ByteMeter(), device=r.device, label="eval",
                                            **wire)  # not training's
        self.in_b = r.bounds[s - 1] if s else None
        self.out_b = r.bounds[s] if s < m.pp - 1 else None
        links = r.links
        dp_group = (make_dp_group(self.meter) if make_dp_group else
                    DistGroup(self.groups.dp[s], m.dp, self.meter, "dp", links.dp_mbps, links.dp_latency_ms))
        self.rk = StageRank(cfg, self.stage, self.role.replica, self.in_b, self.out_b, self.transport, dp_group,
                            DistGroup(self.groups.pp[self.role.replica], m.pp, self.meter, None),
                            DTYPES[cfg.train.dtype])
        self.feed = (anchor_feed(cfg, self.stage, self.role.replica, self.layout, self.rank, self.groups, self.meter,
                                 links, wire_dtype(cfg)) if m.anchor else None)
        self.step_index, self._bytes, self._grad_norm = 0, {a: 0 for a in AXES}, 0.0
        self._router_aux = 0.0
        self._rank_rows: list[dict] = []  # the last step's ranks.jsonl rows (the lead's; engine/rank_rows.py)
        self.rk.worker.times.slow = slow_factor(self.rank)  # THINPIPE_SLOW_RANK (tests and benchmarks)
        self._complete = -1  # the newest checkpoint set every rank holds
        self._fault_at = fault_at_step()  # crash-recovery tests only (thinpipe/faults.py)
        self._trained = False  # a load after a step is a rollback
        # train.objective's step over this rank (objective/registry.py)
        self.pipe = DistPipe(self, r.tokenizer)
        self.objective = make_objective(cfg, self.pipe, r.train_ds, r.val_ds, r.tokenizer, [r.bounds])

    # --------------------------------------------------------------------------------------------
    def gather(self, values: list[float]) -> list[torch.Tensor]:
        """Every fast rank's ``values`` (float64), in global rank order."""
        t = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(t) for _ in range(self.layout.dp * self.layout.pp)]
        dist.all_gather(out, t, group=self.groups.fast)
        return out

    def residual_start(self) -> None:
        """SimMesh.residual_start across ranks: boundary by boundary, replica 0's stages run the
        batches up to the sender, which computes the start; every fast rank holding the boundary
        loads it (a payload broadcast over the fast ranks; metered on ``pp_params`` by the owner as in the
        simulation: ``start_copies``)."""
        wanted = residual_start_boundaries(self.bounds)
        batches = self.objective.residual_batches() if wanted else []
        for p in wanted:
            out: dict[int, list[torch.Tensor]] = {}
            if self.role.replica == 0:
                for _ in residual_pass(self.stage, self.in_b, self.out_b, self.eval_transport, batches, {p}, 0, out):
                    pass
            src = self.layout.grid[0][p]
            payload: Payload | None = None
            if self.rank == src:  # replica 0's sender of boundary p: its out boundary is p
                assert self.out_b is not None
                payload = self.out_b.init_from_residuals(torch.cat(out[p]))
            payload = broadcast_payload(payload, src, self.groups.fast, self.device, self.bounds[p].param_expect())
            if self.rank == src:  # metered once, by the owner, as the simulation does
                self.meter.add("pp_params", payload.nbytes * start_copies(self.layout.dp))
            for b in (self.in_b, self.out_b):
                if b is not None and b.index == p:
                    b.load_init(payload)
        self.objective.start()

    def before_step(self, step: int) -> int:
        if step == self._fault_at:
            raise RuntimeError(f"THINPIPE_FAULT_AT_STEP: injected fault at step {step}")
        return step

    def commit_step(self, step: int, loss: float) -> float | None:
        """After this rank's share of the step (``objective/``'s step over ``DistPipe``; ``loss``: the mean over
        replicas, the same on every rank): the mesh's bytes and gradient norm. Always committed here (None: an
        ``ElasticEngine`` step that did not commit)."""
        self._trained = True
        self.record_step(step)
        self.step_index = step + 1
        return loss

    def tokens_seen(self) -> int:
        return self.objective.tokens

    def my_vector(self) -> list[float]:
        """This rank's step for ``ranks.jsonl`` (engine/rank_rows.py)."""
        row, s = self.layout.grid[self.role.replica], self.role.stage
        return rank_vector(self.rk.worker.times.take(), self.transport.link_rates(), row[s - 1] if s else None,
                           row[s + 1] if s < len(row) - 1 else None)

    def record_step(self, step: int) -> None:
        """After a step: the whole mesh's bytes, replica 0's gradient norm (every rank decides alike on it) and
        every rank's times, in one collective over the fast ranks."""
        mine = self.meter.snapshot()
        rows = self.gather([self.rk.last_grad_norm, self.rk.router_aux, *self.my_vector(),
                            *(mine[a] for a in AXES)])
        first = 2 + VECTOR
        self._bytes = {a: int(sum(float(r[first + i]) for r in rows)) for i, a in enumerate(AXES)}
        self._grad_norm = float(rows[0][0])
        self._router_aux = sum(float(r[1]) for r in rows) / self.layout.dp  # stages summed, replicas averaged
        if self.lead:
            self._rank_rows = rows_of(step, {k: r[2:first].tolist() for k, r in enumerate(rows)},
                                      dict(enumerate(self.layout.grid[:self.layout.dp])))

    def after_schedule(self, step: int) -> None:
        """Between a step's pipeline schedule and its DP syncs (fault-injection point of the elastic tests)."""

    def grad_norm(self) -> float:
        return self._grad_norm

    def router_aux_loss(self) -> float | None:
        return self._router_aux if self.stage.family.experts else None

    def rank_rows(self) -> list[dict]:
        rows, self._rank_rows = self._rank_rows, []
        return rows

    def bytes_total(self) -> dict[str, int]:
        """Every fast rank's metered bytes as of the last step (at the end, the anchor ranks' too:
        each reported them to its stage's fast ranks in its end message; replica 0 counts them once)."""
        return dict(self._bytes)

    def captured_energy(self) -> dict | None:
        """As the simulation's: each sender of replica 0 measures its own boundary."""
        if not self.bounds or self.bounds[0].subspace() is None:
            return None
        batch = next(val_batches(self.val_ds, self.cfg.train.batch_size))
        out: dict[int, list[torch.Tensor]] = {}
        if self.role.replica == 0:
            for _ in residual_pass(self.stage, self.in_b, self.out_b, self.eval_transport, [batch],
                                   set(range(len(self.bounds))), self.step_index, out):
                pass
        mine = [0.0, 0.0]
        if self.stage.index in out:
            assert self.out_b is not None  # residual_pass measured at this stage's own boundary
            mine = list(energy_vs_fixed(torch.cat(out[self.stage.index]), self.out_b.subspace(), self.cfg.train.seed,
                                        self.out_b.index))
        rows = self.gather(mine)
        senders = [rows[self.layout.grid[0][b.index]] for b in self.bounds]
        return {"learned": [float(r[0]) for r in senders], "fixed": [float(r[1]) for r in senders]}

    def diagnostics(self) -> dict | None:
        return None

    # checkpoints --------------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        mine = all(bool(torch.isfinite(p).all()) for p in self.stage.parameters())
        return all(float(r[0]) == 1.0 for r in self.gather([1.0 if mine else 0.0]))

    def save(self, folder: Path, extra: dict) -> None:
        """Every rank writes its part ``rank{r}`` of the set ``step{N}/`` (``thinpipe/checkpoint.py``);
        only once all have (barrier) does any rank drop its part of older sets, so a crash at any
        moment (here or on another machine) leaves a set every rank holds.
        With an anchor circuit its ranks write their parts first (``AnchorFeed.checkpoint``: every
        fast rank waits for their acknowledgement), so the barrier also means the anchor's are written.
        """
        step, part = self.step_index, f"rank{self.rank}"
        anchor = self.feed.checkpoint(step, self._complete) if self.feed is not None else None
        save_part(step_dir(folder, step), part,
                  {"step": step, "world_size": self.world_size, "role": self.role.__dict__,
                   "rank": self.rk.state_dict(),
                   "boundaries": {b.index: held_state(b.state_dict())
                                  for b in (self.in_b, self.out_b) if b is not None},
                   "bytes": self.meter.snapshot(), "anchor": anchor, **extra, "objective": self.objective.state_dict()})
        if step == fault_at_checkpoint() and self.rank == self.layout.dp * self.layout.pp - 1:
            raise RuntimeError(f"THINPIPE_FAULT_AT_CHECKPOINT: injected fault while checkpointing step {step}")
        dist.barrier(group=self.groups.fast)
        self._complete = step
        prune(folder, self.cfg.train.keep_checkpoints, [part])

    def load(self, folder: Path) -> tuple[int, dict]:
        # a rollback (after a step) agrees among the fast ranks; a resume among every rank, the anchor's too
        step, state = (agreed_set(folder, self.rank, self.world_size, self.groups.fast, self.layout.dp * self.layout.pp)
                       if self._trained else agreed_set(folder, self.rank, self.world_size))
        self.step_index, self._complete = state["step"], step
        if self.feed is not None:
            if self._trained:  # a rollback: the anchor circuit goes back to this set too
                self.feed.rollback(step)
            self.feed.load_state_dict(state["anchor"])
        for b in (self.in_b, self.out_b):
            if b is not None:
                missing, unexpected = b.load_state_dict(state["boundaries"][b.index], strict=False)
                if unexpected or set(missing) & set(held_state(b.state_dict())):  # only placeholders may be absent
                    raise ConfigError(f"--resume: boundary {b.index}'s checkpoint does not match this run "
                                      f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
        # the objective's data streams restart at the loaded step
        self.objective.load_state_dict(state.pop("objective", {}), state["step"])
        self.load_rank(state)
        # The receiver's copy of shared boundary parameters equals the owner's again (not metered:
        # a resume re-sync, not training traffic).
        row = self.role.replica
        if self.out_b is not None and self.out_b.has_shared_params:
            self.eval_transport.send(Params(row, self.out_b.index), self.out_b.owner_params(), None)
        if self.in_b is not None and self.in_b.has_shared_params:
            self.in_b.receiver_load_params(self.eval_transport.recv(Params(row, self.in_b.index),
                                                                    self.in_b.param_expect()))
        self.eval_transport.flush()
        self.meter.totals.update(state["bytes"])
        self._bytes = {a: int(float(sum(r[i] for r in self.gather([float(self.meter.totals[a]) for a in AXES]))))
                       for i, a in enumerate(AXES)}
        # what the run loop and an engine saved besides this rank's state (val_points, an elastic replica's counters)
        return state["step"], {k: v for k, v in state.items() if k not in PART_KEYS}

    def load_rank(self, state: dict) -> None:
        """Restore the stage rank; re-posting its syncs in flight talks to the DP group at once."""
        for work in self.rk.load_state_dict(state["rank"]):
            work.wait()

    # the end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Stop the anchor circuit; its ranks' bytes join the totals (replica 0 counts them once)."""
        if self.feed is None:
            return
        self.feed.finish(self._complete)
        extra = [float(self.feed.anchor_bytes[a]) if self.role.replica == 0 else 0.0 for a in AXES]
        rows = self.gather(extra)
        for i, a in enumerate(AXES):
            self._bytes[a] += int(sum(float(r[i]) for r in rows))

    def write_model(self, dest: Path) -> dict:
        """``OUT/model/`` on global rank ``train.model_rank`` (0 by default; ``engine/job_model.py``): replica 0's
        stages send it their shares over the eval wire (authenticated, not training's bytes; ``model_bytes``),
        and it writes the folder into its own ``--out``; the lead's summary learns the bytes from every fast rank."""
        if any(b.architectural for b in self.bounds):
            if self.lead:
                say(architectural_line(self.cfg))
            return {"model": None, "model_bytes": 0}
        writer, pp = self.cfg.train.model_rank, self.layout.pp
        if self.role.replica == 0 or self.rank == writer:
            for p in self.stage.parameters():  # the last step's gradients: nothing reads them now, the model needs room
                p.grad = None
            release_freed_heap()  # and the heap's free pages (training's freed activations), before the shares
        # a sender's share is its stage's own tensors (``flat`` copies them once); the writer's its own copy
        share = model_share(self.stage, self.rk.dp_scheme, copy=self.rank == writer) if self.role.replica == 0 else None
        received = 0
        if share is not None and self.rank != writer:
            self.eval_transport.send(ModelShare(self.role.stage, writer), flat(share), None)
            self.eval_transport.flush()
        if self.rank == writer:
            loaded, stages = skeleton(self.cfg)
            shares = [share if share is not None and self.layout.grid[0][s] == self.rank else
                      unflat(self.eval_transport.recv(ModelShare(s, writer), flat_expect(stages[s])), stages[s])
                      for s in range(pp)]
            write_model(loaded, shares, dest, self.cfg)
            received = sent_bytes(shares, writer)
            del loaded, shares
            release_freed_heap()  # the gathered model's pages, before the run's last lines and its plot
        gathered = int(sum(float(x[0]) for x in self.gather([float(received)])))
        return model_summary(dest, gathered, writer, self.cfg) if self.lead else {}

    def summary_extras(self) -> dict:
        mine = [float(self.rk.trainable_count()), float(self.rk.model_count())] if self.role.replica == 0 else [0., 0.]
        counts = self.gather(mine)
        memory = self.gather([float(sum(b.memory_bytes() for b in (self.in_b, self.out_b) if b is not None))])
        return {"engine": "dist", "params": int(sum(float(c[1]) for c in counts)),
                "trainable_params": int(sum(float(c[0]) for c in counts)),
                "boundary_memory_bytes": int(sum(float(m[0]) for m in memory)),
                **(self.feed.summary() if self.feed else {}),
                **({"split_auto": self.split_auto} if self.split_auto else {})}

    def close(self) -> None:
        transports = [self.transport, self.eval_transport]
        if self.feed is not None:
            transports += [self.feed.pull_transport, self.feed.push_transport]
        for tr in transports:
            tr.close()


def train_dist(cfg: Config, out: str | Path, progress: bool = True, resume: bool = False) -> dict | None:
    """Run this process's rank of a distributed training run; rank 0 writes the run folder and
    returns the summary (other ranks return None). ``resume`` continues from the per-rank
    checkpoints in ``out/checkpoint`` (the same trajectory as an uninterrupted run)."""
    check_supported(cfg)
    exit_with_launcher()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ConfigError("--engine dist must be started by torchrun (or `thinpipe launch --nproc N -- train ...`)")
        # A peer that dies leaves the others blocked in a receive or collective: they give up after
        # this many seconds with an error instead of hanging (torchrun tears a local job down sooner).
        timeout_s = dist_timeout_s()
        # gloo even where CUDA exists: the wire is TCP between machines on thin links, and a GPU
        # rank stages what it sends through host memory (comm/staging.py, docs/gpu.md), so message
        # order, tags and sums do not depend on the backend. Every listener on the job's address.
        job_key("--engine dist")  # before anything starts: a rank without the key says so in one line
        init_gloo(timeout_s)
    rank: AnchorStageRank | DistEngine | None = None
    try:
        setup = RankSetup.build(cfg)
        role, st = setup.role, setup.stage
        say(f"[thinpipe rank {role.rank}/{setup.layout.world_size}] {role.circuit} replica {role.replica}, "
            f"stage {role.stage} (layers {st.first_layer}-{st.first_layer + len(st.layers) - 1})")
        if role.circuit == "anchor":
            # Off the critical path: cycles until the fast circuit stops it (see anchor/dist_rank.py).
            rank = anchor_rank(setup, Path(out) / "checkpoint")
            if resume:
                _, state = agreed_set(Path(out) / "checkpoint", role.rank, setup.layout.world_size)
                rank.load_state_dict(state["anchor_rank"], state["bytes"])
            rank.run(fault_at_cycle=fault_anchor_at_cycle() if st.is_last else -1)
            return None
        rank = DistEngine(setup)
        return run(rank, cfg, Path(out), resume=resume, progress=progress)
    finally:
        if rank is not None:
            rank.close()
        dist.destroy_process_group()
