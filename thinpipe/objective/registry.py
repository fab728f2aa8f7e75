"""The objectives by name (``train.objective``): the one place an objective is looked up (docs/architecture.md: a
new objective).

A built-in objective is a module of this package with a ``SPEC`` (``spec.py: ObjectiveSpec``), listed in ``BUILTIN``
(its name also in ``config/post.py: OBJECTIVES``, which the config checks ``train.objective`` against); one from
outside registers its spec with ``plugins.py: register_objective`` when its module is imported (``THINPIPE_PLUGINS``).
Everything else asks the spec: the engines build the objective and its data through it, the anchor circuit its
pass, the run loop how its held-out measure is reported.
"""

from __future__ import annotations

from thinpipe.config import ConfigError
from thinpipe.config.post import OBJECTIVES
from thinpipe.objective import dpo, gspo, sft
from thinpipe.objective.base import Objective
from thinpipe.objective.pipe import Pipe, check_rows
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.objective.task_scores import TaskScores, WithTasks
from thinpipe.plugins import PLUGIN_OBJECTIVES

BUILTIN: dict[str, ObjectiveSpec] = {m.SPEC.name: m.SPEC for m in (sft, dpo, gspo)}
assert tuple(BUILTIN) == OBJECTIVES, "an objective's name is in config/post.py: OBJECTIVES and its SPEC here"


def spec_of(cfg) -> ObjectiveSpec:
    """``train.objective``'s spec (a built-in one, or one a plugin registered)."""
    return spec_named(cfg.train.objective)


def spec_named(name: str) -> ObjectiveSpec:
    """The spec of the objective called ``name``; one line naming the choices when there is none."""
    spec = BUILTIN.get(name) or PLUGIN_OBJECTIVES.get(name)
    if not isinstance(spec, ObjectiveSpec):
        raise ConfigError(f"train.objective = {name!r} is not an objective: choose one of "
                          f"{', '.join([*BUILTIN, *PLUGIN_OBJECTIVES])} (a plugin's objective needs its module in "
                          "THINPIPE_PLUGINS)")
    return spec


def make_objective(cfg, pipe: Pipe, train_ds, val_ds, tokenizer, bounds_by_replica: list) -> Objective:
    """``train.objective``'s objective over ``pipe`` (``bounds_by_replica``: the boundaries of each replica the pipe
    drives, for the checks an objective makes of them), with ``eval.tasks`` scored beside its held-out measure
    (``task_scores.py``)."""
    objective = spec_of(cfg).build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica)
    return WithTasks(objective, TaskScores(cfg, pipe, tokenizer)) if cfg.eval.tasks else objective


def build_data(cfg, tokenizer) -> tuple:
    """(train, held-out) rows of ``train.objective`` (``ObjectiveSpec.data``)."""
    return spec_of(cfg).data(cfg, tokenizer)


def wants_reference(cfg) -> bool:
    """Every rank keeps a frozen copy of the starting weights (``ObjectiveSpec.needs_reference``)."""
    return bool(spec_of(cfg).needs_reference(cfg))


def anchor_contexts(cfg, rows: dict, index: int, tag: int, device) -> list:
    """``train.objective``'s anchor pass of ``rows`` (``Objective.anchor_rows``) at update ``index``, replica
    ``tag``, on ``device``."""
    return spec_of(cfg).anchor_contexts(cfg, rows, index, tag, device)


def anchor_rows_bytes(cfg) -> int:
    """At most the bytes of the rows a pull carries (``objective/pipe.py: pack_rows``): three int64 tensors of
    ``train.seq_len`` tokens per row, the per-row float32 tensors (at most as wide), two scalars."""
    s = spec_of(cfg)
    n, t = s.anchor_max_rows(cfg), cfg.train.seq_len
    return n * t * (8 * 3 + 4 * len(s.anchor_per_row(cfg))) + 64 if n else 0


def check_anchor_rows(cfg, rows: dict, vocab: int) -> None:
    """Refuse rows a pull carried that this run's objective would not have sent (``objective/pipe.py: check_rows``)."""
    s = spec_of(cfg)
    check_rows(rows, s.anchor_per_row(cfg), s.anchor_max_rows(cfg), cfg.train.seq_len, vocab)
