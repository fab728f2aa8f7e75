"""The objectives by name (``train.objective``; the names are ``config/post.py: OBJECTIVES``): the one place an
objective is added (docs/architecture.md: a new objective).

An objective is a module of this package with ``build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica)``
(its ``Objective``, ``base.py``) and what the anchor circuit's pass needs of it in any process: ``anchor_contexts(cfg,
rows, index, tag, device)`` (its pass of ``Objective.anchor_rows``), ``anchor_per_row(cfg)`` (the per-row tensors
a pull carries) and ``anchor_max_rows(cfg)`` (the most rows it carries; 0 when the anchor reads its own shard).
"""

from __future__ import annotations

from thinpipe.config.post import OBJECTIVES
from thinpipe.objective import dpo, gspo, sft
from thinpipe.objective.base import Objective
from thinpipe.objective.pipe import Pipe, check_rows

MODULES = {"sft": sft, "dpo": dpo, "gspo": gspo}
assert tuple(MODULES) == OBJECTIVES, "an objective's name is in config/post.py: OBJECTIVES and its module here"


def make_objective(cfg, pipe: Pipe, train_ds, val_ds, tokenizer, bounds_by_replica: list) -> Objective:
    """``train.objective``'s objective over ``pipe`` (``bounds_by_replica``: the boundaries of each replica the pipe
    drives, for the checks an objective makes of them)."""
    return MODULES[cfg.train.objective].build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica)


def anchor_contexts(cfg, rows: dict, index: int, tag: int, device) -> list:
    """``train.objective``'s anchor pass of ``rows`` (``Objective.anchor_rows``) at update ``index``, replica
    ``tag``, on ``device``."""
    return MODULES[cfg.train.objective].anchor_contexts(cfg, rows, index, tag, device)


def anchor_rows_bytes(cfg) -> int:
    """At most the bytes of the rows a pull carries (``objective/pipe.py: pack_rows``): three int64 tensors of
    ``train.seq_len`` tokens per row, the per-row float32 tensors (at most as wide), two scalars."""
    m = MODULES[cfg.train.objective]
    n, t = m.anchor_max_rows(cfg), cfg.train.seq_len
    return n * t * (8 * 3 + 4 * len(m.anchor_per_row(cfg))) + 64 if n else 0


def check_anchor_rows(cfg, rows: dict, vocab: int) -> None:
    """Refuse rows a pull carried that this run's objective would not have sent (``objective/pipe.py: check_rows``)."""
    m = MODULES[cfg.train.objective]
    check_rows(rows, m.anchor_per_row(cfg), m.anchor_max_rows(cfg), cfg.train.seq_len, vocab)
