"""The DP scheme interface: what one stage rank's data-parallel synchronisation does (docs/dp.md).

A scheme is one class, in the shape of torchft's ``LocalSGD`` / ``DiLoCo`` (a wrapper over a model's
parameters with hooks around the inner optimizer step that talks only to a group's all-reduce):
``rank/stage_rank.py: StageRank`` builds the configured one (``dp/registry.py: build_scheme``) bound to
the stage's trained parameters and its DP group, and calls

  ``sync_grads(step, grads)``   before the optimizer step: the per-step gradient average (or nothing)
  ``after_step(step)``          after it: DiLoCo's outer step, Streaming DiLoCo's fragment posts and finishes
  ``state_dict()`` / ``load_state_dict(state)``   its checkpointed state; loading re-posts what was in flight
  ``repost()``                  the DP group was rebuilt (elastic replicas changed): re-post what is in flight
  ``synchronised()``            the weights the replicas agree on (DiLoCo's outer weights), for an export

each a generator that yields a ``comm/protocols.py: Work`` whenever it posted a collective, so the
simulation's lockstep driver and a real rank drive it unchanged. What the planner, its advice and the
elastic engine need to know of a scheme it says itself, from the ``[dp]`` config alone: ``DPKind``'s
class methods (``dp/kinds.py``, torch-free), which a ``DPScheme`` inherits. No code outside ``dp/`` names
a scheme.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from thinpipe.comm.protocols import Group
from thinpipe.config.dp import DPConfig
from thinpipe.dp.kinds import DPKind

Trained = Callable[[], list[tuple[str, torch.nn.Parameter]]]


class DPScheme(DPKind):
    """One stage rank's DP synchronisation; the base never talks (every hook a no-op).

    Built once per rank with the ``[dp]`` section (``cfg``), a function giving the stage's trained
    ``(name, parameter)`` pairs (what an outer step and its global copy cover), the stage's DP group
    and this rank's member index in it, and a ``seed`` equal on every replica of a stage and distinct
    per stage. Averages divide by ``group.size``, read when they run: across elastic replicas it is
    the current quorum's.
    """

    def __init__(self, cfg: DPConfig, trained: Trained, group: Group, member: int, seed: int):
        self.cfg, self.trained, self.group, self.member, self.seed = cfg, trained, group, member, seed

    # the step's hooks -------------------------------------------------------------------------
    def sync_grads(self, step: int, grads: dict[str, torch.Tensor]) -> Generator:
        """Before the optimizer step of step ``step``: average ``grads`` (every gradient of the stage, by
        parameter name) in place over the group, or leave them."""
        yield from ()

    def after_step(self, step: int) -> Generator:
        """After the optimizer step of step ``step``: whatever moves the weights between replicas."""
        yield from ()

    def agree_after(self, step: int) -> bool:
        """Whether every replica's trained weights are equal once step ``step``'s hooks have run."""
        return self.replicas_agree_every_step

    def synchronised(self) -> dict[str, torch.Tensor] | None:
        """The trained weights every replica holds alike (by parameter name), when they are not this rank's own:
        the job's model, which a run's export takes (docs/data.md, "A run's model"). None: the rank's own weights
        are (a scheme whose replicas agree every step)."""
        return None

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scheme's checkpointed state: its keys sit beside the rank's ``stage`` and ``optimizer``."""
        return {}

    def load_state_dict(self, state: dict) -> Generator:
        """Restore from a rank's state (the keys ``state_dict`` wrote; absent ones are left as built);
        a generator because a sync saved in flight is posted again, which talks to the group."""
        yield from ()

    def repost(self) -> Generator:
        """The group was rebuilt (elastic replicas joined or left): post again what is in flight on it."""
        yield from ()
