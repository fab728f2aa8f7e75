"""Cheap checks of a command line before anything heavy loads: names (model, data, tasks,
dashboards) that would otherwise fail only after a model is loaded, and the run folder a command
writes or reads. Each failure is one ``ConfigError`` line (the CLI's exit code 2)."""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

from thinpipe.config import ConfigError
from thinpipe.runlock import check_out_path

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "checkpoint", "init", "tensorboard",
             "wandb")  # what `train` writes


def validate_names(cfg) -> None:
    """Cheap checks of names that would otherwise fail only after loading a model."""
    from thinpipe.data import CORPORA
    from thinpipe.data.rows import data_files
    from thinpipe.models.loading import is_random_preset, model_num_layers, resolve_model_name

    name = resolve_model_name(cfg.model.name)
    if cfg.train.lora.rank and cfg.train.lora.save == "adapter" and is_random_preset(name):
        raise ConfigError(f"train.lora.save = adapter names the base model's folder, but {cfg.model.name} is a random "
                          "preset with none on disk: leave train.lora.save = merged (the whole model is written)")
    for name in (cfg.data.name, cfg.data.val_name):
        if name and name not in CORPORA:  # a user's files: absolute, so a --resume from elsewhere finds them
            data_files(name)
            if name == cfg.data.name:
                cfg.data.name = str(Path(name).resolve())
            else:
                cfg.data.val_name = str(Path(name).resolve())
    layers = model_num_layers(cfg.model.name)
    if layers is not None and cfg.mesh.pp > layers:
        raise ConfigError(f"mesh.pp = {cfg.mesh.pp} stages but {cfg.model.name} has only {layers} decoder layers: "
                          f"use mesh.pp <= {layers}")
    split = cfg.mesh.fixed_split
    if layers is not None and split and sum(split) != layers:
        raise ConfigError(f"mesh.split = {split} covers {sum(split)} layers but {cfg.model.name} has {layers}")
    if cfg.eval.tasks:
        validate_tasks(cfg.eval.tasks)
    from thinpipe.dashboards import check_installed

    check_installed(cfg)


def validate_tasks(tasks: list[str], extra: list[str] = ()) -> None:
    from thinpipe.eval.tasks import TASKS

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(sorted(TASKS) + list(extra))}")


def made_by_thinpipe(out: Path) -> bool:
    """Whether a folder was written by thinpipe (a config.toml of thinpipe's own sections, or an elastic
    job's events): --overwrite removes files only from such a folder, never from a user's project that
    happens to hold a ``config.toml`` or a ``checkpoint/``. (Not the lock file: this very command's
    launcher may just have made it.)"""
    if (out / "events.jsonl").is_file():
        return True
    try:
        saved = tomllib.loads((out / "config.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return all(isinstance(saved.get(k), dict) for k in ("model", "mesh", "train", "boundary"))


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Before anything is created or loaded: --out is a folder path, and a folder that holds a run is
    never written over by accident (--resume continues it, --overwrite replaces a thinpipe run)."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out, --overwrite replaces it: give one of them")
    check_out_path(out)
    held = [n for n in RUN_FILES if (out / n).exists()]
    if not held or resume:
        return
    if not overwrite:
        raise ConfigError(f"--out {out} holds a run ({', '.join(held)}): add --resume to continue it, --overwrite to "
                          "replace it, or choose another --out")
    if not made_by_thinpipe(out):
        raise ConfigError(f"--out {out} holds {', '.join(held)} but no thinpipe run (no thinpipe config.toml): "
                          "--overwrite removes only a run's files; choose another --out")


def claim_out(out: Path, resume: bool, overwrite: bool) -> None:
    """--overwrite: the files `train` writes are removed (nothing else), once ``check_out`` has passed
    and this job holds the folder's lock (``runlock.py``)."""
    if resume or not overwrite:
        return
    held = [n for n in RUN_FILES if (out / n).exists() or (out / n).is_symlink()]
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine removes (dist ranks share the folder)
        for n in held:
            shutil.rmtree(out / n) if (out / n).is_dir() and not (out / n).is_symlink() else (out / n).unlink()


def check_run(run: Path | list[Path]) -> None:
    """A run folder of any engine (or a dist job's machines' folders, several): a config and a checkpoint there,
    the simulation's, a dist job's ranks' parts, or an elastic job's replica folders (``replica*/``)."""
    from thinpipe.checkpoint import has_checkpoint, refuse_legacy

    runs = [Path(r) for r in (run if isinstance(run, list) else [run])]
    configured = any((r / "config.toml").is_file() or any(r.glob("replica*/config.toml")) for r in runs)
    held = any(has_checkpoint(r) or any(has_checkpoint(d) for d in r.glob("replica*") if d.is_dir()) for r in runs)
    if not configured or not held:
        for r in runs:
            refuse_legacy(r / "checkpoint")
        raise ConfigError(f"--run {' --run '.join(map(str, runs))}: no run with a checkpoint there; give the --out "
                          "folder of a `thinpipe train` or `thinpipe launch` run")


