"""Dashboards people already use (``[log]``): TensorBoard, Weights & Biases, trackio.

Each takes exactly the scalars of ``metrics.jsonl`` under the same names (a nested dict such as
``diag`` or ``captured_energy`` is flattened with "/"), at the row's step, and at the last step the
final held-out loss (``val_loss``) and the summary's numbers as ``summary/...``; ``metrics.jsonl``
stays the record, the dashboards are views.
None is a dependency: a sink that is asked for and not installed is one clear error before training.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from thinpipe.config import Config, ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
WANDB_STEP = "thinpipe/step"  # the x axis of every W&B chart: the metrics row's step


def check_installed(cfg: Config) -> None:
    """A requested dashboard whose package is missing: one line saying how to install it."""
    for key, package in PACKAGES.items():
        if getattr(cfg.log, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"log.{key} = true but {package} is not installed: pip install {package} (or set "
                              f"log.{key} = false)")


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics row (bools and the step excluded), nested dicts flattened with "/"."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "step" and not prefix:
            continue
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


class Dashboards:
    """The configured sinks of one run folder (the lead process only)."""

    def __init__(self, cfg: Config, out: Path, start_step: int = 0):
        check_installed(cfg)
        self.sinks = []
        name = Path(out).resolve().name
        if cfg.log.tensorboard:
            self.sinks.append(_TensorBoard(Path(out) / "tensorboard", start_step))
        if cfg.log.wandb:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            run = wandb.init(project=cfg.log.project, name=name, dir=str(out), config=cfg.to_dict(), mode=mode,
                             id=_wandb_id(Path(out), start_step), resume="allow")
            # our step as the x axis: W&B's own step only grows, so a rolled-back run's redone steps
            # would be dropped if they were logged as its step
            run.define_metric(WANDB_STEP)  # ("step" itself is W&B's reserved name: it would be dropped)
            run.define_metric("*", step_metric=WANDB_STEP)
            self.sinks.append(_Callable(lambda s, step: run.log({**s, WANDB_STEP: step}), run.finish))
        if cfg.log.trackio:
            import trackio

            trackio.init(project=cfg.log.project, name=name, config=cfg.to_dict())
            self.sinks.append(_Callable(lambda s, step: trackio.log(s, step=step), trackio.finish))

    @classmethod
    def none(cls) -> "Dashboards":
        """No sinks (a rank that writes no run folder)."""
        self = cls.__new__(cls)
        self.sinks = []
        return self

    def log(self, row: dict) -> None:
        values = scalars(row)
        for sink in self.sinks:
            sink.log(values, row["step"])

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint of ``step``: the steps after it are redone."""
        for sink in self.sinks:
            sink.rewind(step)

    def summary(self, summary: dict, step: int) -> None:
        numbers = scalars({k: v for k, v in summary.items() if k != "val_points"})
        values = {f"summary/{k}": v for k, v in numbers.items()}
        for sink in self.sinks:
            sink.log(values, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _wandb_id(out: Path, start_step: int) -> str:
    """The W&B run id of this run folder: a resumed run (start_step > 0) continues the same W&B run."""
    import uuid

    path = out / "wandb" / "thinpipe_run_id"
    if start_step and path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(uuid.uuid4().hex[:12])
    return path.read_text()


class _TensorBoard:
    def __init__(self, folder: Path, start_step: int):
        self.folder = folder
        self.rewind(start_step)

    def rewind(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if getattr(self, "writer", None) is not None:
            self.writer.close()
        # purge_step: TensorBoard drops the events at or after it that earlier files hold (a resumed
        # or rolled-back run redoes those steps)
        self.writer = SummaryWriter(str(self.folder), purge_step=step or None)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a crash loses nothing that metrics.jsonl has

    def close(self) -> None:
        self.writer.close()


class _Callable:
    def __init__(self, log, finish):
        self._log, self._finish = log, finish

    def log(self, values: dict[str, float], step: int) -> None:
        self._log(values, step)

    def rewind(self, step: int) -> None:
        pass  # the redone steps are logged again at their step (W&B: the WANDB_STEP metric; trackio: step=)

    def close(self) -> None:
        self._finish()
