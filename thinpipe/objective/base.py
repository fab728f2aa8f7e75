"""What an objective is to the engines (docs/architecture.md: one step path): SFT, DPO and GSPO implement it alike.

An objective owns its data (streams per replica it drives, held-out rows; how they are read is its
``spec.py: ObjectiveSpec``, with everything else that is not its step), builds the microbatch contexts of a step
(``rank/context.py``: ids, labels, and for DPO / GSPO the last stage's ``loss_fn`` and its per-row tensors), hands
them to its ``Pipe`` (``objective/pipe.py``: one per engine, the only code that knows a transport) and turns what the
last stages report into the step's loss and metrics. The run loop (``engine/loop.py``) calls these methods; an engine
only builds it (``registry.make_objective``) and brackets its step: no engine names an objective.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from thinpipe.rank.context import MicrobatchContext


@runtime_checkable
class Objective(Protocol):
    tokens: int    # trained (non-padding for DPO / GSPO) tokens of every replica this process's pipe sums over

    def start(self) -> None:
        """Once, before the first step of a new run (never on a resume): state computed from the starting weights
        (DPO's reference log-probs). Nothing for SFT and GSPO."""
        ...

    def residual_batches(self) -> list[dict]:
        """The rows a data-driven boundary start (MAPL's PCA start, outlier channels) computes on."""
        ...

    def step(self, step: int) -> float:
        """One training step through the pipe (its updates, anchor priors and all); the step's training loss,
        the same number on every process."""
        ...

    anchor_local: bool  # the anchor circuit draws its rows from its own shard (SFT); else they travel with a pull

    def anchor_rows(self, index: int, ctxs: dict[int, list[MicrobatchContext]]) -> dict:
        """The rows of the anchor circuit's unmasked pass for a cycle that starts at update ``index`` (``ctxs``: the
        update's contexts by replica), as named tensors: SFT's next batch of the anchor's own shard; DPO's and
        GSPO's replica 0 rows of the update with what their loss reads per row. ``registry.anchor_contexts`` turns
        them into the pass (in the simulation, or on an anchor rank after a pull carried them)."""
        ...

    def validation(self) -> float:
        """The held-out measure (its spec's ``val_key``), the same number on every process."""
        ...

    def validation_metrics(self) -> dict:
        """Further held-out numbers of the last ``validation()``, written beside the measure in its row and as
        ``final_<key>`` in the summary (DPO's ``val_dpo_accuracy`` and ``val_dpo_margin``; SFT, GSPO: none)."""
        ...

    def metrics(self) -> dict:
        """The objective's own metrics of the last step (rows' extra keys; SFT: none)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore what ``state_dict`` saved (``step``: the step trained next, where the data streams restart)."""
        ...
