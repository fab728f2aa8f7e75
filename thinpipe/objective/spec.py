"""What an objective says of itself (docs/architecture.md: a new objective): one ``ObjectiveSpec`` per objective,
the only thing the run loop, the engines, the anchor circuit and the commands ask about it.

The step itself is the ``Objective`` (``base.py``) that ``build`` makes over a ``Pipe``; everything that is not the
step lives here, so that no engine, rank or command has to know which objective runs: its data (``data``), whether
every rank keeps a frozen copy of the starting weights (``needs_reference``), how its held-out measure is reported
(``val_key``, ``val_is_loss``, ``val_perplexity``, the labels of ``loss.png``) and what the anchor circuit's pass
needs of it in whichever process runs the anchor (``anchor_*``, anchor-priors §3: the anchor trains the same
objective on clean boundaries). A built-in objective is a module of this package with a ``SPEC``; one from outside
is registered with ``plugins.py: register_objective(SPEC)`` (``tests/architecture/test_toy_objective.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _never(cfg) -> bool:
    return False


def _no_per_row(cfg) -> tuple[str, ...]:
    return ()


def _no_rows(cfg) -> int:
    return 0


def _local_anchor(cfg, rows, index, tag, device) -> list:
    raise AssertionError("an objective whose anchor reads its own shard (anchor_max_rows = 0) builds its anchor "
                         "contexts itself: give ObjectiveSpec.anchor_contexts")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveSpec:
    name: str
    """``train.objective``'s value that selects it."""
    build: Callable
    """``build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica) -> Objective`` (``base.py``): its step over
    ``pipe`` (``bounds_by_replica``: the boundaries of each replica the pipe drives, for the checks it makes)."""
    data: Callable
    """``data(cfg, tokenizer) -> (train, held_out)``: the rows it trains and measures on (SFT: packed corpus rows;
    DPO: preference pairs; GSPO: prompts with reference answers). Every engine and command that reads a run's data
    calls this (``registry.build_data``)."""
    val_key: str
    """The held-out measure's key in ``metrics.jsonl`` rows and ``summary.json`` (``final_<key>``)."""
    val_is_loss: bool = True
    """The held-out measure is a loss (lower is better, plotted beside the training loss) rather than a score with
    its own axis (GSPO's greedy accuracy)."""
    val_perplexity: bool = False
    """The held-out measure is a next-token loss in nats per token, so ``summary.json`` also gives ``val_ppl``."""
    loss_label: str = "loss"
    """The training loss's axis label in ``loss.png``."""
    val_label: str = "held-out"
    """The held-out curve's legend in ``loss.png``."""
    needs_reference: Callable = _never
    """``needs_reference(cfg) -> bool``: every rank keeps a frozen copy of its stage's starting weights on dense
    boundaries (``Pipe.forward(..., "reference")``; GSPO with a KL to the start)."""
    anchor_contexts: Callable = _local_anchor
    """``anchor_contexts(cfg, rows, index, tag, device) -> [MicrobatchContext]``: the anchor circuit's pass of
    ``Objective.anchor_rows`` at update ``index``, replica ``tag``, in whichever process runs the anchor."""
    anchor_per_row: Callable = _no_per_row
    """``anchor_per_row(cfg) -> names``: the per-row float32 tensors a pull carries beside the rows."""
    anchor_max_rows: Callable = _no_rows
    """``anchor_max_rows(cfg) -> int``: the most rows a pull carries; 0 when the anchor reads its own shard."""

    def __post_init__(self) -> None:
        if not self.name or not self.val_key:
            raise ValueError("an ObjectiveSpec needs a name and a val_key")
        for field in ("build", "data", "needs_reference", "anchor_contexts", "anchor_per_row", "anchor_max_rows"):
            if not callable(getattr(self, field)):
                raise ValueError(f"ObjectiveSpec {self.name!r}: {field} must be callable")
