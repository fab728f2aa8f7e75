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
from thinpipe.comm import AXES
from thinpipe.config import Config, ConfigError, Diverged, load_config
from thinpipe.console import say
from thinpipe.dashboards import Dashboards
from thinpipe.faults import nan_at_step
from thinpipe.jsonl import read_rows
from thinpipe.rank.from_config import lr_at


class Engine(Protocol):
    lead: bool          # this process writes the run folder
    world_size: int     # the mesh's processes (simulated or real)

    def residual_start(self) -> None: ...
    def at_step(self, step: int) -> int: ...                   # next step to train (an elastic replica may join later)
    def train_step(self, step: int) -> float | None: ...       # the step's mean training loss over replicas; None:
    #                                                            not committed (elastic: a replica was lost), redo it
    def tokens_seen(self, step: int) -> int: ...               # training tokens of the whole mesh up to this step
    def grad_norm(self) -> float: ...
    def bytes_total(self) -> dict[str, int]: ...               # cumulative, whole mesh, per axis
    def validation_loss(self) -> float: ...
    def captured_energy(self) -> dict | None: ...
    def diagnostics(self) -> dict | None: ...
    def weights_finite(self) -> bool: ...                      # every rank's parameters (the same answer on all)
    def save(self, folder: Path, extra: dict) -> None: ...
    def load(self, folder: Path) -> tuple[int, dict]: ...      # (step, extra)
    def finish(self) -> None: ...
    def summary_extras(self) -> dict: ...
    # train.objective's held-out measure's row key (``val_loss``, GSPO's ``val_accuracy``) and its own metrics of
    # the last step (objective/: DPO's margin and accuracy, GSPO's rewards; SFT's: none)
    val_key: str
    def step_metrics(self) -> dict: ...


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


def plot_losses(metrics: list[dict], val_points: list, path: Path, val_key: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1, label="train (compressed circuit)")
    if val_points and val_key == "val_loss":
        ax.plot(*zip(*val_points), "o-", label="held-out (unmasked)")
    elif val_points:  # an accuracy: its own axis
        ax.twinx().plot(*zip(*val_points), "o-", color="C1", label="held-out accuracy (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)" if metrics and "reward_mean" not in metrics[-1] else "loss")
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


def run(engine: Engine, cfg: Config, out: Path, resume: bool = False, progress: bool = True) -> dict | None:
    """Train ``engine`` as configured; the lead returns the summary (also in ``out/summary.json``)."""
    t = cfg.train
    ckpt = out / "checkpoint"
    vk = engine.val_key
    start, val_points = 0, []
    if resume:
        with restoring(ckpt):  # a hand-edited part whose digests verify: one line (checkpoint.py)
            start, extra = engine.load(ckpt)
            start, val_points = operator.index(start), [(int(s), float(v)) for s, v in extra["val_points"]]
    else:
        engine.residual_start()
    last_good = start if resume else None  # the newest checkpoint this run can go back to
    metrics = _read_rows(out / "metrics.jsonl", start, say if engine.lead else None) if resume else []
    if engine.lead:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())
        with open(out / "metrics.jsonl", "w") as f:  # rows after the checkpoint are redone
            f.writelines(json.dumps(m) + "\n" for m in metrics)
    wall0 = time.perf_counter() - (metrics[-1]["wall_s"] if metrics else 0.0)
    if not val_points:
        val_points.append((0, engine.validation_loss()))
    bar = tqdm(total=t.steps, desc="train", disable=not (progress and engine.lead), initial=start, file=sys.stderr,
               dynamic_ncols=True)
    rollbacks, step = 0, start
    nan_at = nan_at_step()  # divergence tests only: one NaN loss (thinpipe/faults.py)
    f = open(out / "metrics.jsonl", "a") if engine.lead else _Discard()
    dash = Dashboards(cfg, out, start) if engine.lead else Dashboards.none()
    shown = {"val": f"{val_points[-1][1]:.3f}"}
    try:
        while step < t.steps:
            joined = engine.at_step(step)  # an elastic replica that joined a running job goes on at the job's step
            if joined != step:
                step, bar.n = joined, joined
                bar.refresh()
                if step >= t.steps:
                    break
            loss = engine.train_step(step)
            if loss is None:  # not committed (elastic: a replica left mid-step); rolled back: the step again
                continue
            if step == nan_at:
                loss, nan_at = float("nan"), -1
            diverged = (None if math.isfinite(loss) and math.isfinite(engine.grad_norm()) else
                        f"loss {loss}, gradient norm {engine.grad_norm()}")
            if diverged is None:
                b = engine.bytes_total()
                row = {"step": step, "loss": loss, "lr": lr_at(cfg, step), "tokens": engine.tokens_seen(step),
                       "grad_norm": engine.grad_norm(), **{f"{a}_bytes": b[a] for a in AXES},
                       "wall_s": time.perf_counter() - wall0}
                row.update(engine.step_metrics())
                diag = engine.diagnostics()
                if diag is not None:
                    row["diag"] = diag
                if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < t.steps:
                    row[vk] = engine.validation_loss()
                    val_points.append((step + 1, row[vk]))
                    energy = engine.captured_energy()
                    if energy:
                        row["captured_energy"] = energy
                metrics.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                dash.log(row)
                bar.update(1)
                if vk in row:
                    shown["val"] = f"{row[vk]:.3f}"
                bar.set_postfix(loss=f"{loss:.3f}", val=shown["val"], lr=f"{row['lr']:.2e}",
                                wire=_rate(sum(b[a] for a in AXES), row["wall_s"]))
                if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps:
                    if engine.weights_finite():  # a checkpoint never holds a diverged state
                        engine.save(ckpt, {"val_points": val_points})
                        last_good = step + 1
                    else:
                        diverged = "non-finite weights after its update"
            if diverged is None:
                step += 1
                continue
            if t.on_divergence != "rollback" or last_good is None or rollbacks >= t.max_rollbacks:
                raise _diverged(step, diverged, last_good, ckpt, t.lr, rollbacks)
            rollbacks += 1
            step, metrics, val_points = _rollback(engine, cfg, out, ckpt, step, diverged, rollbacks, metrics, f)
            dash.rewind(step)
            bar.n = step
            bar.refresh()
    except BaseException:
        dash.close()
        raise
    finally:
        f.close()
        bar.close()
    wall = time.perf_counter() - wall0
    if not engine.weights_finite():
        raise _diverged(t.steps - 1, "non-finite weights after its update", last_good, ckpt, t.lr, rollbacks)
    engine.save(ckpt, {"val_points": val_points})  # before the anchor circuit stops: its ranks write their parts
    engine.finish()
    final_val = engine.validation_loss()
    val_points.append((t.steps, final_val))
    b = engine.bytes_total()
    extras = engine.summary_extras()
    if not engine.lead:
        return None
    tokens = engine.tokens_seen(t.steps - 1)
    summary = {
        "engine": extras.pop("engine"), "world_size": engine.world_size, "steps": t.steps, "tokens": tokens,
        f"initial_{vk}": val_points[0][1], "final_train_loss": metrics[-1]["loss"] if metrics else None,
        f"final_{vk}": final_val, **({"val_ppl": math.exp(final_val)} if t.objective == "sft" else {}),
        "objective": t.objective,
        **{f"{a}_bytes": b[a] for a in AXES}, "bytes_per_token": {a: b[a] / tokens for a in AXES},
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None, "rollbacks": rollbacks,
        **extras, "val_points": val_points,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # the metrics rows' convention: a row's val_loss is measured after its step, so the final one
    # belongs to the last row's step
    dash.log({"step": t.steps - 1, vk: final_val})
    dash.summary(summary, t.steps - 1)
    dash.close()
    b_cfg = cfg.boundary
    plot_losses(metrics, val_points, out / "loss.png", vk,
                f"{cfg.model.name} on {cfg.data.name}: {summary['engine']} pp={cfg.mesh.pp} dp={cfg.mesh.dp} "
                f"{b_cfg.kind}{'' if b_cfg.kind == 'identity' else f' p={b_cfg.p}'}")
    return summary


def _rate(nbytes: float, seconds: float) -> str:
    """Bytes the mesh sent per second of this run, for the progress bar (e.g. "1.2MB/s")."""
    r = nbytes / seconds if seconds > 0 else 0.0
    for unit in ("B", "kB", "MB", "GB"):
        if r < 1000 or unit == "GB":
            return f"{r:.3g}{unit}/s"
        r /= 1000


def _diverged(step: int, what: str, last_good: int | None, ckpt: Path, lr: float, rollbacks: int = 0) -> Diverged:
    """The one line a diverged run ends with; nothing is checkpointed after it, so the newest
    checkpoint stays the last good one."""
    back = (f"the last good checkpoint is step {last_good} in {ckpt} (--resume continues from it)"
            if last_good is not None else "no checkpoint was written before it")
    tried = f" after {rollbacks} rollback{'s' if rollbacks != 1 else ''}" if rollbacks else ""
    return Diverged(f"training diverged at step {step} ({what}){tried}; {back}: lower train.lr (now {lr}), set "
                    "train.on_divergence = rollback, or compress less")


def _rollback(engine: Engine, cfg: Config, out: Path, ckpt: Path, step: int, what: str, n: int, metrics: list,
              f) -> tuple[int, list, list]:
    """``train.on_divergence = rollback``: the last good checkpoint again, with ``train.lr`` lowered
    (recorded in config.toml, so a later --resume keeps it); the rows after it are dropped."""
    t = cfg.train
    t.lr *= t.rollback_lr_factor
    back, extra = engine.load(ckpt)
    say(f"[thinpipe] diverged at step {step} ({what}): rolled back to the checkpoint of step {back} with train.lr = "
        f"{t.lr:g} (rollback {n} of at most {t.max_rollbacks})")
    metrics = [m for m in metrics if m["step"] < back]
    if engine.lead:
        (out / "config.toml").write_text(cfg.to_toml())
        f.seek(0)
        f.truncate()
        f.writelines(json.dumps(m) + "\n" for m in metrics)
        f.flush()
    return back, metrics, [tuple(v) for v in extra["val_points"]]


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
