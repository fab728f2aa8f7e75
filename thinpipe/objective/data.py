"""What the objectives' data functions share (``spec.py: ObjectiveSpec.data``): the ``data`` keys every reader takes,
and the checks of a user's files and of enough rows for one step."""

from __future__ import annotations

from pathlib import Path

from thinpipe.config import Config, ConfigError


def common_data_args(cfg: Config) -> dict:
    """The ``[data]`` settings every dataset reader takes (a chat format, the held-out split, bad rows)."""
    d = cfg.data
    return {"chat_format": d.chat_format, "val_name": d.val_name, "val_fraction": d.val_fraction,
            "skip_bad_rows": d.skip_bad_rows}


def users_files(cfg: Config) -> str:
    """``data.name`` of an objective that reads a user's files: refused in one line when it is not a file or folder."""
    name = cfg.data.name
    if not Path(name).exists():
        raise ConfigError(f"train.objective = {cfg.train.objective} reads a user's files: data.name = {name!r} is "
                          "not a file or folder (docs/rl.md shows the row formats)")
    return name


def enough_rows(cfg: Config, rows: int, need: int, what: str, lower: str) -> None:
    """One step needs ``need`` training rows (``what``); fewer is refused in one line naming what to change."""
    if rows < need:
        raise ConfigError(f"data {cfg.data.name!r} holds {rows} training {what}, fewer than one step needs ({need}): "
                          f"{lower}")
