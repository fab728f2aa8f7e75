"""The training run: config -> model, data, mesh -> steps -> metrics, checkpoints, summary, plot.

Everything a run produces lands in its output folder: ``config.toml`` (fully resolved),
``metrics.jsonl`` (one object per step), ``summary.json``, ``loss.png`` and ``checkpoint/``
(written atomically; ``--resume`` continues the same trajectory).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from thinpipe.comm import AXES
from thinpipe.config import Config, ConfigError, load_config
from thinpipe.engine.sim import SimMesh
from thinpipe.models.lora import apply_lora, merge_lora

METRIC_AXES = AXES  # every metered axis, as the meter defines them


def build_data(cfg: Config, tokenizer):
    from thinpipe.data import build_dataset

    t, d = cfg.train, cfg.data
    train = build_dataset(d.name, tokenizer, t.seq_len, "train", t.seed, d.max_examples or None)
    val = build_dataset(d.name, tokenizer, t.seq_len, "val", t.seed)
    if len(train) < t.batch_size * cfg.mesh.dp:
        raise ConfigError(f"data {d.name!r} packs into {len(train)} training rows of {t.seq_len} tokens, fewer than one "
                          f"step needs ({t.batch_size} x {cfg.mesh.dp} replicas): lower train.batch_size or raise "
                          "data.max_examples")
    if d.val_rows:
        val.input_ids, val.labels, val.segment_ids = (val.input_ids[:d.val_rows], val.labels[:d.val_rows],
                                                      val.segment_ids[:d.val_rows])
    return train, val


def validation_loss(mesh: SimMesh, val, batch_size: int) -> float:
    total, n = 0.0, 0
    for i in range(0, len(val), batch_size):
        batch = {"input_ids": val.input_ids[i:i + batch_size], "labels": val.labels[i:i + batch_size],
                 "segment_ids": val.segment_ids[i:i + batch_size]}
        s, c = mesh.eval_loss(batch)
        total, n = total + s, n + c
    return total / max(n, 1)


def projector_energy(mesh: SimMesh, val, batch_size: int, seed: int) -> dict | None:
    """Per boundary with a projector: captured energy of the first validation batch's residual by the
    projector and by a fixed random basis of the same rank (MAPL Fig. 4b, tracked over training)."""
    from thinpipe.analysis import captured_energy
    from thinpipe.analysis.report import projector_of
    from thinpipe.optim.stiefel import orthonormal

    if not mesh.boundaries or projector_of(mesh.boundaries[0]) is None:
        return None
    batch = {"input_ids": val.input_ids[:batch_size], "labels": val.labels[:batch_size],
             "segment_ids": val.segment_ids[:batch_size]}
    out = {"learned": [], "fixed": []}
    for b, X in zip(mesh.boundaries, mesh.boundary_residuals([batch])):
        A = projector_of(b)
        out["learned"].append(captured_energy(X, A))
        out["fixed"].append(captured_energy(X, orthonormal(A.shape[0], A.shape[1],
                                                           torch.Generator().manual_seed(seed + 17 + b.index))))
    return out


def trainable_params(mesh: SimMesh) -> int:
    seen = {id(p): p.numel() for st in mesh.replicas[0] for p in st.parameters() if p.requires_grad}
    pair = mesh.tied[0]
    # a trained tied matrix is one parameter held twice (its second copy on the last stage)
    return sum(seen.values()) - (pair[1].numel() if pair is not None and pair[1].requires_grad else 0)


def anchor_summary(mesh: SimMesh) -> dict:
    if mesh.anchor is None:
        return {}
    seen = mesh.anchor.staleness_seen
    return {"priors_consumed": mesh.priors_consumed,
            "anchor_staleness_mean": sum(seen) / len(seen) if seen else None,
            "anchor_staleness_max": max(seen) if seen else None}


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(mesh: SimMesh, out: Path, extra: dict) -> None:
    _atomic_save({"mesh": mesh.state_dict(), **extra}, out / "checkpoint" / "state.pt")


def plot_losses(metrics: list[dict], val_points: list[tuple[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1, label="train (masked circuit)")
    if val_points:
        ax.plot(*zip(*val_points), "o-", label="held-out (unmasked)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg: Config, out: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run training as configured; returns the summary dict (also written to ``out/summary.json``)."""
    from thinpipe.data import batches
    from thinpipe.models import load_model

    out = Path(out)
    ckpt_path = out / "checkpoint" / "state.pt"
    if resume and not ckpt_path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {ckpt_path}; start without --resume")
    if resume:
        saved_cfg = load_config(out / "config.toml")
        if saved_cfg.to_dict() != cfg.to_dict():
            print(f"[thinpipe] --resume continues the run as configured in {out / 'config.toml'}; "
                  "the config given on the command line is ignored", file=sys.stderr)
            cfg = saved_cfg
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    loaded = load_model(cfg.model.name, seed=cfg.train.seed)
    apply_lora(loaded.model, cfg.train.lora)
    n_layers = loaded.model.config.num_hidden_layers
    if cfg.mesh.pp > n_layers:
        raise ConfigError(f"mesh.pp = {cfg.mesh.pp} stages but {cfg.model.name} has only {n_layers} layers")
    train_ds, val_ds = build_data(cfg, loaded.tokenizer)
    mesh = SimMesh(loaded.model, cfg)
    if cfg.boundary.init == "pca" and cfg.boundary.kind in ("mapl", "mapl-vq") and not resume:
        # Its own data stream (another seed) so the training data order is the same as a random start's.
        pca_stream = batches(train_ds, cfg.train.batch_size, cfg.train.seed + 1_000_003)
        mesh.pca_start([next(pca_stream) for _ in range(cfg.boundary.pca_batches)])
    (out / "config.toml").write_text(cfg.to_toml())

    t = cfg.train
    start, metrics, val_points = 0, [], []
    if resume:
        state = torch.load(ckpt_path, weights_only=False)
        mesh.load_state_dict(state["mesh"])
        start, val_points = mesh.step_index, state["val_points"]
        with open(out / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
        metrics = [m for m in metrics if m["step"] < start]
    wall0 = time.perf_counter() - (metrics[-1]["wall_s"] if metrics else 0.0)
    if not val_points:
        val_points.append((0, validation_loss(mesh, val_ds, t.batch_size)))
    shards = cfg.mesh.dp + cfg.mesh.anchor  # the anchor replica trains on its own shard
    streams = [batches(train_ds, t.batch_size, t.seed, shard=r, num_shards=shards, start_step=start)
               for r in range(cfg.mesh.dp)]
    anchor_stream = None
    if mesh.anchor is not None:
        cycles_done = -(-start // mesh.anchor.every)  # cycles started at steps 0, every, 2 every, ... < start
        anchor_stream = batches(train_ds, t.batch_size, t.seed, shard=cfg.mesh.dp, num_shards=shards,
                                start_step=cycles_done)
    tokens_per_step = t.batch_size * t.seq_len * cfg.mesh.dp
    with open(out / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
    bar = tqdm(range(start, t.steps), desc="train", disable=not progress, initial=start, total=t.steps,
               file=sys.stderr, dynamic_ncols=True)
    with open(out / "metrics.jsonl", "a") as f:
        for step in bar:
            lr = mesh.lr_at(step)
            anchor_batch = next(anchor_stream) if anchor_stream and mesh.anchor.starts_at(step) else None
            loss = mesh.train_step([next(s) for s in streams], anchor_batch)
            if not math.isfinite(loss):
                save_checkpoint(mesh, out, {"val_points": val_points})
                raise RuntimeError(f"training diverged at step {step}: loss = {loss}; lower train.lr "
                                   f"(now {t.lr}) or boundary.p; checkpoint saved in {out / 'checkpoint'}")
            b = mesh.meter.snapshot()
            row = {"step": step, "loss": loss, "lr": lr, "tokens": (step + 1) * tokens_per_step,
                   "grad_norm": mesh.last_grad_norm, **{f"{a}_bytes": b[a] for a in METRIC_AXES},
                   "wall_s": time.perf_counter() - wall0}
            if mesh.last_diagnostics is not None:
                row["diag"] = mesh.last_diagnostics
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < t.steps:
                row["val_loss"] = validation_loss(mesh, val_ds, t.batch_size)
                val_points.append((step + 1, row["val_loss"]))
                energy = projector_energy(mesh, val_ds, t.batch_size, t.seed)
                if energy:
                    row["captured_energy"] = energy
            metrics.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
            if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0:
                save_checkpoint(mesh, out, {"val_points": val_points})
    wall = time.perf_counter() - wall0
    final_val = validation_loss(mesh, val_ds, t.batch_size)
    val_points.append((t.steps, final_val))
    save_checkpoint(mesh, out, {"val_points": val_points})
    b = mesh.meter.snapshot()
    tokens = t.steps * tokens_per_step
    summary = {
        "steps": t.steps, "tokens": tokens,
        "initial_val_loss": val_points[0][1],
        "final_train_loss": metrics[-1]["loss"] if metrics else None,
        "final_val_loss": final_val, "val_ppl": math.exp(final_val),
        **{f"{a}_bytes": b[a] for a in METRIC_AXES},
        "bytes_per_token": {a: b[a] / tokens for a in METRIC_AXES},
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
        "trainable_params": trainable_params(mesh),
        "boundary_memory_bytes": mesh.boundary_memory_bytes(),
        **anchor_summary(mesh),
        "val_points": val_points,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_losses(metrics, val_points, out / "loss.png",
                f"{cfg.model.name} on {cfg.data.name}: pp={cfg.mesh.pp} dp={cfg.mesh.dp} "
                f"{cfg.boundary.kind}{'' if cfg.boundary.kind == 'identity' else f' p={cfg.boundary.p}'}")
    return summary


def load_mesh(run: str | Path):
    """(config, mesh restored from the checkpoint, LoadedModel) of a finished or checkpointed run."""
    from thinpipe.models import load_model

    run = Path(run)
    if not (run / "config.toml").is_file() or not (run / "checkpoint" / "state.pt").is_file():
        raise ConfigError(f"{run} is not a thinpipe run folder (needs config.toml and checkpoint/state.pt)")
    cfg = load_config(run / "config.toml")
    loaded = load_model(cfg.model.name, seed=cfg.train.seed)
    apply_lora(loaded.model, cfg.train.lora)
    mesh = SimMesh(loaded.model, cfg)
    mesh.load_state_dict(torch.load(run / "checkpoint" / "state.pt", weights_only=False)["mesh"])
    return cfg, mesh, loaded


def load_run(run: str | Path):
    """(config, merged Hugging Face model, tokenizer) of a finished or checkpointed run."""
    from thinpipe.config import ARCHITECTURAL_KINDS
    from thinpipe.models import merge_stages

    cfg, mesh, loaded = load_mesh(run)
    if cfg.boundary.kind in ARCHITECTURAL_KINDS:
        raise ConfigError(f"{run} trained with boundary.kind = {cfg.boundary.kind}, whose projectors are part of "
                          "the model: a plain Hugging Face model would drop them. `thinpipe eval --model RUN` evaluates "
                          "it through its boundaries; `thinpipe analyze --run RUN` inspects them")
    return cfg, merge_lora(merge_stages(loaded.model, mesh.replicas[0])), loaded.tokenizer


def export(run: str | Path, out: str | Path) -> Path:
    """Write replica 0's weights as a Hugging Face folder that ``from_pretrained`` loads."""
    _, model, tokenizer = load_run(run)
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".export-"))
    try:
        model.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp), out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
