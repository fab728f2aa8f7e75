"""The simulation as an engine of the run loop (``engine/loop.py``): the whole mesh in this process.

``SimMesh`` (``engine/sim_mesh.py``) is the mesh; this adds what a run needs around it, as the distributed
engine does for its rank: the data streams of every replica and of the anchor, the held-out loss,
the checkpoint (one part, ``mesh``, of a set ``checkpoint/step{N}/``: ``thinpipe/checkpoint.py``) and
the summary's extras.
"""

from __future__ import annotations

from pathlib import Path

import torch

from thinpipe.analysis import energy_vs_fixed
from thinpipe.checkpoint import latest_complete, prune, refuse_legacy, save_part, step_dir
from thinpipe.config import Config, ConfigError
from thinpipe.console import say
from thinpipe.engine.job_model import architectural_line, model_share, model_summary, sent_bytes, skeleton, write_model
from thinpipe.engine.loop import resolve_resume, run
from thinpipe.engine.rank_rows import rank_vector, rows_of
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.engine.sim_pipe import SimPipe
from thinpipe.objective.registry import build_data, make_objective
from thinpipe.rank.from_config import load, place, val_batches


def mesh_validation_loss(mesh: SimMesh, val, batch_size: int) -> float:
    """Replica 0's held-out loss over ``val`` (token mean): the next-token objective's held-out measure (``thinpipe
    prune``)."""
    total, n = 0.0, 0
    for batch in val_batches(val, batch_size):
        s, c = mesh.eval_loss(batch)
        total, n = total + s, n + c
    return total / max(n, 1)


def trainable_params(mesh: SimMesh) -> int:
    return sum(rk.trainable_count() for rk in mesh.ranks[0])


class SimEngine:
    lead = True

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = place(cfg)
        loaded = load(cfg)
        self.tokenizer = loaded.tokenizer
        self.train_ds, self.val_ds = build_data(cfg, loaded.tokenizer)
        self.mesh = SimMesh(loaded.model, cfg, self.device)
        self.world_size = (cfg.mesh.dp + cfg.mesh.anchor) * cfg.mesh.pp
        # train.objective's step over every replica (objective/registry.py)
        self.objective = make_objective(cfg, SimPipe(self.mesh, loaded.tokenizer), self.train_ds, self.val_ds,
                                        loaded.tokenizer, self.mesh.replica_boundaries)

    def residual_start(self) -> None:
        if any(b.wants_residual_init for b in self.mesh.boundaries):
            self.mesh.residual_start(self.objective.residual_batches())
        self.objective.start()

    def before_step(self, step: int) -> int:
        return step

    def commit_step(self, step: int, loss: float) -> float:
        self.mesh.step_index = step + 1
        return loss

    def tokens_seen(self) -> int:
        return self.objective.tokens

    def grad_norm(self) -> float:
        return self.mesh.last_grad_norm

    def rank_rows(self) -> list[dict]:
        """The last step's ``ranks.jsonl`` rows (engine/rank_rows.py): each simulated rank's compute; the ranks share
        this process, so none waits and no link is timed."""
        m = self.cfg.mesh
        vectors = {rk.replica * m.pp + rk.index: rank_vector(rk.worker.times.take(), {}, None, None)
                   for rk in self.mesh.all_ranks()}
        return rows_of(self.mesh.step_index - 1, vectors,
                       {r: [r * m.pp + s for s in range(m.pp)] for r in range(m.dp)})

    def router_aux_loss(self) -> float | None:
        """A mixture of experts' router loss in the last step (models/router_loss.py): every stage's summed, the
        replicas' averaged; None for a dense model."""
        if not self.mesh.replicas[0][0].family.experts:
            return None
        return sum(rk.router_aux for rk in self.mesh.all_ranks()) / self.cfg.mesh.dp

    def bytes_total(self) -> dict[str, int]:
        return self.mesh.meter.snapshot()

    def captured_energy(self) -> dict | None:
        """Per boundary with a subspace: captured energy of the first validation batch's residual by
        it and by a fixed random basis of the same rank (MAPL Fig. 4b, tracked over training)."""
        bounds = self.mesh.boundaries
        if not bounds or bounds[0].subspace() is None:
            return None
        batch = next(val_batches(self.val_ds, self.cfg.train.batch_size))
        out: dict[str, list[float]] = {"learned": [], "fixed": []}
        for b, X in zip(bounds, self.mesh.boundary_residuals([batch])):
            # the kinds with a subspace are part of the model, which applies to every boundary (no boundary.masked)
            U = b.subspace()
            assert U is not None
            learned, fixed = energy_vs_fixed(X, U, self.cfg.train.seed, b.index)
            out["learned"].append(learned)
            out["fixed"].append(fixed)
        return out

    def diagnostics(self) -> dict | None:
        return self.mesh.last_diagnostics

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for rk in self.mesh.all_ranks() for p in rk.stage.parameters())

    def save(self, folder: Path, extra: dict) -> None:
        save_part(step_dir(folder, self.mesh.step_index), "mesh",
                  {"mesh": self.mesh.state_dict(), **extra, "objective": self.objective.state_dict()})
        prune(folder, self.cfg.train.keep_checkpoints, ["mesh"])

    def load(self, folder: Path) -> tuple[int, dict]:
        found = latest_complete(folder, "mesh", warn=say)
        if found is None:
            refuse_legacy(folder)
            raise ConfigError(f"--resume: no checkpoint in {folder}; start without --resume")
        _, state = found
        self.mesh.load_state_dict(state.pop("mesh"))
        # its data streams restart at the loaded step
        self.objective.load_state_dict(state.pop("objective", {}), self.mesh.step_index)
        return self.mesh.step_index, state

    def finish(self) -> None:
        pass

    def write_model(self, dest: Path) -> dict:
        """``OUT/model/`` from replica 0's stages (``engine/job_model.py``); ``model_bytes``: what they would send to
        the rank that writes it on real processes (``train.model_rank``)."""
        if any(b.architectural for b in self.mesh.boundaries):
            say(architectural_line(self.cfg))
            return {"model": None, "model_bytes": 0}
        shares = [model_share(rk.stage, rk.dp_scheme) for rk in self.mesh.ranks[0]]
        write_model(skeleton(self.cfg)[0], shares, dest, self.cfg)
        writer = self.cfg.train.model_rank
        return model_summary(dest, sent_bytes(shares, writer), writer, self.cfg)

    def summary_extras(self) -> dict:
        return {"engine": "sim", "params": sum(rk.model_count() for rk in self.mesh.ranks[0]),
                "trainable_params": trainable_params(self.mesh),
                "boundary_memory_bytes": self.mesh.boundary_memory_bytes(),
                **(self.mesh.anchor.summary() if self.mesh.anchor else {}),
                **({"split_auto": self.mesh.split_auto} if self.mesh.split_auto else {})}


def train(cfg: Config, out: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run training in the simulation as configured; returns the summary (also in ``out/summary.json``)."""
    out = Path(out)
    cfg = resolve_resume(cfg, out, resume)
    summary = run(SimEngine(cfg), cfg, out, resume=resume, progress=progress)
    assert summary is not None  # the simulation is the lead (SimEngine.lead): it always has the summary
    return summary
