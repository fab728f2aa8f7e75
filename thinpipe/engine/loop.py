"""The run loop, written once for both engines (docs/architecture.md: one run loop, two engines).

Everything a run produces lands in its output folder: ``config.toml`` (fully resolved),
``metrics.jsonl`` (one row per step, appended and flushed as the step ends), ``summary.json``,
``loss.png`` and ``checkpoint/`` (written atomically; ``--resume`` continues the same trajectory).
The loop owns the step loop, the rows, validation, the checkpoint cadence, the summary and the plot;
an engine (``Engine`` below: the simulation in ``sim_engine.py``, a rank of the real mesh in
``dist_engine.py``) owns how a step, a held-out loss or a checkpoint is computed over its transport. The
two engines write the same keys; a test compares their files field by field.

Metrics row keys: step, loss, lr, tokens, grad_norm, ``{axis}_bytes`` for every metered axis
(cumulative, whole mesh), wall_s; at eval steps val_loss (and captured_energy for boundaries with a
subspace); diag at diagnostic steps (simulation only).
"""

from __future__ import annotations

import json
import math
import operator
import sys
import time
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from thinpipe.checkpoint import restoring
from thinpipe.comm.meter import AXES
from thinpipe.config import Config, ConfigError, Diverged, load_config
from thinpipe.console import say
from thinpipe.dashboards import Dashboards
from thinpipe.engine.job_model import MODEL_DIR
from thinpipe.engine.rank_rows import RANKS_FILE, slowest
from thinpipe.faults import nan_at_step
from thinpipe.jsonl import read_rows
from thinpipe.objective.base import Objective
from thinpipe.objective.registry import spec_of
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.provenance import code_stamp
from thinpipe.rank.from_config import lr_at


class Engine(Protocol):
    """What the loop asks of a transport (the simulation, a rank of the real mesh, a rank of an elastic replica).
    The loop drives the objective itself (``objective``: its step, held-out measure and metrics); an engine only
    brackets each step (``before_step`` / ``commit_step``) and owns what its transport decides: bytes, gradient
    norm, checkpoints, the summary's extras."""

    lead: bool             # this process writes the run folder
    world_size: int        # the mesh's processes (simulated or real)
    objective: Objective   # train.objective's step over this engine's Pipe (objective/registry.py: make_objective)

    def residual_start(self) -> None: ...
    def before_step(self, step: int) -> int: ...                 # the step to train next (an elastic replica may join
    #                                                              the job later, at its step)
    def commit_step(self, step: int, loss: float) -> float | None: ...  # after the objective's step: the step's mean
    #                                                              training loss over the mesh's replicas; None: not
    #                                                              committed (elastic: a replica was lost), redo it
    def tokens_seen(self) -> int: ...                            # training tokens of the whole mesh so far
    def grad_norm(self) -> float: ...
    def rank_rows(self) -> list[dict]: ...                       # the last step's ranks.jsonl rows (the lead's; []
    #                                                              elsewhere): engine/rank_rows.py
    def router_aux_loss(self) -> float | None: ...               # a mixture of experts' router loss in the last step
    #                                                              (every stage's, replicas averaged); None: dense
    def bytes_total(self) -> dict[str, int]: ...                 # cumulative, whole mesh, per axis
    def captured_energy(self) -> dict | None: ...
    def diagnostics(self) -> dict | None: ...
    def weights_finite(self) -> bool: ...                        # every rank's parameters (the same answer on all)
    def save(self, folder: Path, extra: dict) -> None: ...
    def load(self, folder: Path) -> tuple[int, dict]: ...        # (step, extra)
    def finish(self) -> None: ...
    def write_model(self, dest: Path) -> dict: ...               # OUT/model/ (engine/job_model.py), every rank taking
    #                                                              part; the lead's summary fields ({} elsewhere)
    def summary_extras(self) -> dict: ...


def resolve_resume(cfg: Config, out: Path, resume: bool) -> Config:
    """With --resume the run continues as its folder's config says (the command line's is ignored)."""
    if not resume:
        return cfg
    if not (out / "config.toml").is_file():
        raise ConfigError(f"--resume: no checkpoint in {out} (no config.toml there); start without --resume")
    saved = load_config(out / "config.toml")
    given = cfg.to_dict()
    if given["train"]["dtype"] == "auto":  # the run folder records what auto resolved to
        given["train"]["dtype"] = saved.train.dtype
    if saved.to_dict() != given:
        say(f"[thinpipe] --resume continues the run as configured in {out / 'config.toml'}; "
            "the config given on the command line is ignored")
    return saved


def plot_losses(metrics: list[dict], val_points: list, path: Path, spec: ObjectiveSpec, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1, label="train (compressed circuit)")
    if val_points and spec.val_is_loss:
        ax.plot(*zip(*val_points), "o-", label=spec.val_label)
    elif val_points:  # a score: its own axis
        ax.twinx().plot(*zip(*val_points), "o-", color="C1", label=spec.val_label)
    ax.set_xlabel("step")
    ax.set_ylabel(spec.loss_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_rows(path: Path, before: int, warn=say) -> list[dict]:
    """The rows before the checkpoint; a last line a crash cut off is dropped (``jsonl.py``), and the
    lead rewrites the file from these rows, so every line of it parses again."""
    return [m for m in read_rows(path, warn) if isinstance(m.get("step"), int) and m["step"] < before]


class Rows:
    """The run's rows: ``metrics.jsonl`` (appended and flushed per step, by the lead alone), the dashboards and
    the progress bar; a resume or a rollback rewinds them to a checkpoint's step."""

    def __init__(self, engine: Engine, cfg: Config, out: Path, start: int, resume: bool, progress: bool):
        self.lead, self.out = engine.lead, out
        self.metrics = _read_rows(out / "metrics.jsonl", start, say if engine.lead else None) if resume else []
        if self.lead:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(cfg.to_toml())
        self.f = open(out / "metrics.jsonl", "w") if self.lead else _Discard()
        # where each rank's time goes (engine/rank_rows.py), rewound with the metrics
        self.ranks = _read_rows(out / RANKS_FILE, start, say if engine.lead else None) if resume else []
        self.rf = open(out / RANKS_FILE, "w") if self.lead else _Discard()
        self._rewrite()  # rows after the checkpoint are redone
        self.dash = Dashboards(cfg, out, start) if self.lead else Dashboards.none()
        self.bar = tqdm(total=cfg.train.steps, desc="train", disable=not (progress and self.lead), initial=start,
                        file=sys.stderr, dynamic_ncols=True)
        self.wall0 = time.perf_counter() - (self.metrics[-1]["wall_s"] if self.metrics else 0.0)

    def wall(self) -> float:
        """Seconds of this run so far (a resumed run's rows keep counting from their last)."""
        return time.perf_counter() - self.wall0

    def append(self, row: dict, val_key: str, shown: str, ranks: list[dict]) -> None:
        self.metrics.append(row)
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        self.ranks += ranks
        self.rf.writelines(json.dumps(r) + "\n" for r in ranks)
        self.rf.flush()
        self.dash.log(row)
        self.bar.update(1)
        nbytes = sum(row[f"{a}_bytes"] for a in AXES)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", val=shown, lr=f"{row['lr']:.2e}",
                             wire=_rate(nbytes, row["wall_s"]))

    def go_to(self, step: int) -> None:
        """The bar at ``step`` (an elastic replica that joined a running job goes on at the job's step)."""
        self.bar.n = step
        self.bar.refresh()

    def rewind(self, step: int, cfg: Config) -> None:
        """Back to a checkpoint's ``step``: its rows after it are dropped, ``config.toml`` rewritten (a rollback
        lowered train.lr, which a later --resume keeps)."""
        self.metrics = [m for m in self.metrics if m["step"] < step]
        self.ranks = [r for r in self.ranks if r["step"] < step]
        if self.lead:
            (self.out / "config.toml").write_text(cfg.to_toml())
        self._rewrite()
        self.dash.rewind(step)
        self.go_to(step)

    def _rewrite(self) -> None:
        for f, rows in ((self.f, self.metrics), (self.rf, self.ranks)):
            f.seek(0)
            f.truncate()
            f.writelines(json.dumps(m) + "\n" for m in rows)
            f.flush()

    def close(self) -> None:
        self.f.close()
        self.rf.close()
        self.bar.close()


class Recovery:
    """The checkpoint and rollback policy: a checkpoint every ``train.checkpoint_every`` steps, never of a
    diverged state; on divergence, the one line that stops the run or (``train.on_divergence = rollback``) the
    last good checkpoint again with ``train.lr`` lowered, at most ``train.max_rollbacks`` times."""

    def __init__(self, engine: Engine, cfg: Config, ckpt: Path, last_good: int | None):
        self.engine, self.cfg, self.ckpt = engine, cfg, ckpt
        self.last_good = last_good  # the newest checkpoint this run can go back to
        self.rollbacks = 0

    def after_step(self, step: int, val_points: list) -> str | None:
        """A checkpoint when one is due after ``step``; what diverged when the weights are not finite."""
        t = self.cfg.train
        if not (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps):
            return None
        if not self.engine.weights_finite():  # a checkpoint never holds a diverged state
            return "non-finite weights after its update"
        self.engine.save(self.ckpt, {"val_points": val_points})
        self.last_good = step + 1
        return None

    def diverged(self, step: int, what: str) -> tuple[int, list]:
        """Stop (raise) or roll back: (the step to go on at, the held-out points up to it)."""
        t = self.cfg.train
        if t.on_divergence != "rollback" or self.last_good is None or self.rollbacks >= t.max_rollbacks:
            raise self.stop(step, what)
        self.rollbacks += 1
        t.lr *= t.rollback_lr_factor
        back, extra = self.engine.load(self.ckpt)
        say(f"[thinpipe] diverged at step {step} ({what}): rolled back to the checkpoint of step {back} with "
            f"train.lr = {t.lr:g} (rollback {self.rollbacks} of at most {t.max_rollbacks})")
        return back, [tuple(v) for v in extra["val_points"]]

    def stop(self, step: int, what: str) -> Diverged:
        """The one line a diverged run ends with; nothing is checkpointed after it, so the newest checkpoint
        stays the last good one."""
        t = self.cfg.train
        back = (f"the last good checkpoint is step {self.last_good} in {self.ckpt} (--resume continues from it)"
                if self.last_good is not None else "no checkpoint was written before it")
        tried = (f" after {self.rollbacks} rollback{'s' if self.rollbacks != 1 else ''}" if self.rollbacks else "")
        return Diverged(f"training diverged at step {step} ({what}){tried}; {back}: lower train.lr (now {t.lr}), "
                        "set train.on_divergence = rollback, or compress less")


def _begin(engine: Engine, ckpt: Path, resume: bool) -> tuple[int, list]:
    """(the step to start at, the held-out points so far): a resumed run's checkpoint, or a new run's start."""
    if not resume:
        engine.residual_start()
        return 0, []
    with restoring(ckpt):  # a hand-edited part whose digests verify: one line (checkpoint.py)
        start, extra = engine.load(ckpt)
        return operator.index(start), [(int(s), float(v)) for s, v in extra["val_points"]]


def _row(engine: Engine, cfg: Config, vk: str, step: int, loss: float, wall_s: float, val_points: list) -> dict:
    """A step's metrics row (the module docstring's keys), with the held-out measure ``vk`` when one is due."""
    b, objective = engine.bytes_total(), engine.objective
    row = {"step": step, "loss": loss, "lr": lr_at(cfg, step), "tokens": engine.tokens_seen(),
           "grad_norm": engine.grad_norm(), **{f"{a}_bytes": b[a] for a in AXES}, "wall_s": wall_s,
           **objective.metrics()}
    router = engine.router_aux_loss()
    if router is not None:
        row["router_aux_loss"] = router
    diag = engine.diagnostics()
    if diag is not None:
        row["diag"] = diag
    if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.train.steps:
        row[vk] = objective.validation()
        row.update(objective.validation_metrics())
        val_points.append((step + 1, row[vk]))
        energy = engine.captured_energy()
        if energy:
            row["captured_energy"] = energy
    return row


def run(engine: Engine, cfg: Config, out: Path, resume: bool = False, progress: bool = True) -> dict | None:
    """Train ``engine`` as configured; the lead returns the summary (also in ``out/summary.json``)."""
    t, ckpt, spec, objective = cfg.train, out / "checkpoint", spec_of(cfg), engine.objective
    vk = spec.val_key
    step, val_points = _begin(engine, ckpt, resume)
    rows = Rows(engine, cfg, out, step, resume, progress)
    recovery = Recovery(engine, cfg, ckpt, step if resume else None)
    if not val_points:
        val_points.append((0, objective.validation()))
    nan_at = nan_at_step()  # divergence tests only: one NaN loss (thinpipe/faults.py)
    shown = f"{val_points[-1][1]:.3f}"
    try:
        while step < t.steps:
            joined = engine.before_step(step)  # an elastic replica that joined a running job goes on at its step
            if joined != step:
                step = joined
                rows.go_to(step)
                if step >= t.steps:
                    break
            loss = engine.commit_step(step, objective.step(step))
            if loss is None:  # not committed (elastic: a replica left mid-step); rolled back: the step again
                continue
            if step == nan_at:
                loss, nan_at = float("nan"), -1
            diverged = (None if math.isfinite(loss) and math.isfinite(engine.grad_norm()) else
                        f"loss {loss}, gradient norm {engine.grad_norm()}")
            if diverged is None:
                row = _row(engine, cfg, vk, step, loss, rows.wall(), val_points)
                shown = f"{row[vk]:.3f}" if vk in row else shown
                rows.append(row, vk, shown, engine.rank_rows())
                diverged = recovery.after_step(step, val_points)
            if diverged is None:
                step += 1
                continue
            step, val_points = recovery.diverged(step, diverged)
            rows.rewind(step, cfg)
    except BaseException:
        rows.dash.close()
        raise
    finally:
        rows.close()
    wall = rows.wall()
    if not engine.weights_finite():
        raise recovery.stop(t.steps - 1, "non-finite weights after its update")
    engine.save(ckpt, {"val_points": val_points})  # before the anchor circuit stops: its ranks write their parts
    engine.finish()
    final_val = objective.validation()
    val_points.append((t.steps, final_val))
    summary = _summary(engine, cfg, spec, rows.metrics, val_points, wall, recovery.rollbacks)
    if summary is not None:
        summary.update(slowest(rows.ranks))
    model = engine.write_model(out / MODEL_DIR)  # the job's model on one machine, after its last measurement
    if summary is None:
        return None
    summary.update(model)
    final_more = objective.validation_metrics()
    summary.update({f"final_{k}": v for k, v in final_more.items()})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # the metrics rows' convention: a row's val_loss is measured after its step, so the final one
    # belongs to the last row's step
    rows.dash.log({"step": t.steps - 1, vk: final_val, **final_more})
    rows.dash.summary(summary, t.steps - 1)
    rows.dash.close()
    b_cfg = cfg.boundary
    kinds = "/".join(b_cfg.kinds) or b_cfg.kind
    plot_losses(rows.metrics, val_points, out / "loss.png", spec,
                f"{cfg.model.name} on {cfg.data.name}: {summary['engine']} pp={cfg.mesh.pp} dp={cfg.mesh.dp} "
                f"{kinds}{'' if kinds == 'identity' else f' p={b_cfg.p}'}")
    return summary


def _summary(engine: Engine, cfg: Config, spec: ObjectiveSpec, metrics: list, val_points: list, wall: float,
             rollbacks: int) -> dict | None:
    """``summary.json`` (the lead's; None elsewhere, after the collectives every rank takes part in)."""
    t, vk = cfg.train, spec.val_key
    b = engine.bytes_total()
    extras = engine.summary_extras()
    if not engine.lead:
        return None
    tokens = engine.tokens_seen()
    final_val = val_points[-1][1]
    return {
        "engine": extras.pop("engine"), "world_size": engine.world_size, "steps": t.steps, "tokens": tokens,
        "val_key": vk, f"initial_{vk}": val_points[0][1], "final_train_loss": metrics[-1]["loss"] if metrics else None,
        f"final_{vk}": final_val, **({"val_ppl": math.exp(final_val)} if spec.val_perplexity else {}),
        "objective": t.objective,
        **{f"{a}_bytes": b[a] for a in AXES}, "bytes_per_token": {a: b[a] / tokens for a in AXES},
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None, "rollbacks": rollbacks,
        **extras, "val_points": val_points,
        **code_stamp(),  # which code produced it (thinpipe/provenance.py)
    }


def _rate(nbytes: float, seconds: float) -> str:
    """Bytes the mesh sent per second of this run, for the progress bar (e.g. "1.2MB/s")."""
    r = nbytes / seconds if seconds > 0 else 0.0
    for unit in ("B", "kB", "MB"):
        if r < 1000:
            return f"{r:.3g}{unit}/s"
        r /= 1000
    return f"{r:.3g}GB/s"


class _Discard:
    """A file for ranks that write no run folder."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, _):
        pass

    def flush(self):
        pass

    def close(self):
        pass

    def seek(self, _):
        pass

    def truncate(self):
        pass

    def writelines(self, _):
        pass
