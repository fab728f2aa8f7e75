"""Where a run's metrics go besides ``metrics.jsonl``: the ``[log]`` section (dashboards people use)."""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class LogConfig:
    tensorboard: bool = False
    """Write TensorBoard event files into ``OUT/tensorboard`` with every scalar of ``metrics.jsonl``
    (same names, e.g. ``loss``, ``val_loss``, ``pp_fwd_bytes``) and the summary's numbers
    (``summary/...``); needs ``pip install tensorboard``."""
    wandb: bool = False
    """Log the same scalars to Weights & Biases (``pip install wandb``); offline (files in
    ``OUT/wandb``) unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set."""
    trackio: bool = False
    """Log the same scalars to trackio (``pip install trackio``; local, no account needed)."""
    project: str = "thinpipe"
    """The W&B / trackio project the run is logged under (its name is the run folder's)."""

    def validate(self) -> None:
        if not self.project:
            raise ConfigError("log.project is empty: give a project name, e.g. thinpipe")
