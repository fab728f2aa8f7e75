"""The objective a config trains after SFT (``train.objective``: anchor-priors App. D), built over a ``Pipe``."""

from __future__ import annotations

from thinpipe.rank.dpo import Dpo
from thinpipe.rank.gspo import Gspo
from thinpipe.rank.pipe import Pipe


def make_objective(cfg, pipe: Pipe, train_ds, val_ds, tokenizer, bounds_by_replica: list) -> Dpo | Gspo | None:
    """None for ``sft`` (the engines' own step, unchanged)."""
    if cfg.train.objective == "dpo":
        return Dpo(cfg, pipe, train_ds, val_ds)
    if cfg.train.objective == "gspo":
        return Gspo(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica)
    return None
