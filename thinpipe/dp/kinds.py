"""What each DP scheme says of itself, without torch: the planner (``plan/planner.py``), its advice
(``plan/advice.py``) and the config read it, and ``thinpipe plan`` on a data-sheet device never imports
torch (docs/plan.md). docs/dp.md.

``DPKind`` is the description: class attributes and class methods of the ``[dp]`` config alone (the planner
has no rank). ``dp/scheme.py: DPScheme`` subclasses it with the hooks a rank calls; each built-in scheme is
its description here plus its implementation beside its math (``AllReduce(AllReduceKind, DPScheme)`` in
``allreduce.py``, ...), and a plugin's scheme is one ``DPScheme`` subclass (``plugins.py: register_dp_scheme``),
which is its own description. ``describe(kind)`` finds either; ``dp/registry.py`` builds a rank's scheme.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from thinpipe.config.dp import DPConfig
from thinpipe.plugins import PLUGIN_DP_SCHEMES


@dataclass(frozen=True)
class DPOption:
    """One DP setting the planner's advice may recommend (``plan/advice.py``)."""

    kind: str
    """``dp.kind``."""
    rank: int
    """``dp.rank`` (0: no low-rank compression)."""
    interval: int
    """``dp.inner_steps``: H, the inner steps between exchanges (1: every step)."""
    ratio_x: float
    """How many times smaller one exchange is than a dense one (1: dense)."""
    shown: tuple[str, ...] = ()
    """The settings besides ``dp.kind`` the advice prints (those the scheme reads)."""

    def overrides(self) -> dict:
        """What the advice sets to plan this option."""
        return {"dp.kind": self.kind, "dp.rank": self.rank, "dp.inner_steps": self.interval}

    def settings(self) -> dict[str, str]:
        """What the advice prints: ``dp.kind`` and the settings the scheme reads."""
        o = self.overrides()
        return {"dp.kind": self.kind, **{k: str(o[k]) for k in self.shown}}


def lowrank_ratio(matrices: Sequence[tuple[int, int]], rank: int) -> float:
    """The planner's bytes sent / dense bytes of a rank-``rank`` PowerSGD exchange of ``matrices`` (rows, cols):
    r (n + m) per matrix that shrinks, n m for one that does not (vectors, ~0.1% of a Llama, are left out)."""
    dense = sum(n * m for n, m in matrices)
    sent = sum(min(rank, n, m) * (n + m) if min(rank, n, m) * (n + m) < n * m else n * m for n, m in matrices)
    return sent / dense


class DPKind:
    """A DP scheme's description (the base: a per-step exchange of dense bytes that nobody offers)."""

    kind: ClassVar[str] = ""
    """The ``dp.kind`` it is registered under."""
    replicas_agree_every_step: ClassVar[bool] = True
    """Whether every replica holds the same weights after each step (a per-step average: True; local steps
    between syncs, as DiLoCo's: False; ``DPScheme.agree_after`` says at which steps they do)."""

    @classmethod
    def wire_ratio(cls, cfg: DPConfig, matrices: Sequence[tuple[int, int]]) -> float:
        """rho_dp: one exchange's bytes over a dense average of the trained ``matrices`` (rows, cols)."""
        return 1.0

    @classmethod
    def sync_interval(cls, cfg: DPConfig) -> int:
        """tau: inner steps per exchange (1: every step)."""
        return 1

    @classmethod
    def state_bytes_per_param(cls, cfg: DPConfig) -> int:
        """Bytes of state per trained parameter that a healing replica receives besides the weights and the
        optimizer's (``plan/churn.py: heal_bytes``; DiLoCo's fp32 global copy and outer momentum: 8)."""
        return 0

    @classmethod
    def offers(cls, ranks: Sequence[tuple[int, float]], intervals: Sequence[int]) -> list[DPOption]:
        """The settings the planner's advice may try on its grid of low-rank ``ranks`` ((rank, times smaller);
        rank 0 = dense) and sync ``intervals`` (H); a scheme that offers none is never advised."""
        return []


class AllReduceKind(DPKind):
    """The exact gradient average, every step."""

    kind = "allreduce"

    @classmethod
    def offers(cls, ranks, intervals) -> list[DPOption]:
        return [DPOption(cls.kind, 0, 1, 1.0)]


class PowerSGDKind(DPKind):
    """The gradients' low-rank average, every step, at ``dp.rank`` (4 when 0)."""

    kind = "powersgd"

    @classmethod
    def wire_ratio(cls, cfg, matrices) -> float:
        return lowrank_ratio(matrices, cfg.rank or 4)

    @classmethod
    def offers(cls, ranks, intervals) -> list[DPOption]:
        return [DPOption(cls.kind, r, 1, x, ("dp.rank",)) for r, x in ranks if r]


class DiLoCoKind(DPKind):
    """``dp.inner_steps`` local steps, then an outer step on the averaged pseudo-gradient (low-rank at
    ``dp.rank`` > 0); a global copy and the outer momentum per trained parameter."""

    kind = "diloco"
    replicas_agree_every_step = False

    @classmethod
    def wire_ratio(cls, cfg, matrices) -> float:
        return lowrank_ratio(matrices, cfg.rank) if cfg.rank > 0 else 1.0

    @classmethod
    def sync_interval(cls, cfg) -> int:
        return cfg.inner_steps

    @classmethod
    def state_bytes_per_param(cls, cfg) -> int:
        return 8  # the fp32 global copy and the outer momentum

    @classmethod
    def offers(cls, ranks, intervals) -> list[DPOption]:
        return [DPOption(cls.kind, r, h, x, ("dp.rank", "dp.inner_steps")) for r, x in ranks for h in intervals
                if h > 1]


class StreamingDiLoCoKind(DiLoCoKind):
    """DiLoCo in ``dp.fragments`` staggered fragments, each applied ``dp.overlap`` steps after it is posted
    (the planner counts its average exchange as DiLoCo's; int8 outer gradients are not modelled). Not offered
    by the advice."""

    kind = "streaming-diloco"

    @classmethod
    def offers(cls, ranks, intervals) -> list[DPOption]:
        return []


BUILTIN_KINDS: dict[str, type[DPKind]] = {k.kind: k for k in (AllReduceKind, PowerSGDKind, DiLoCoKind,
                                                                StreamingDiLoCoKind)}


def kinds() -> dict[str, type[DPKind]]:
    """Every scheme's description by kind: the built-in ones (in the order above), then plugins' in
    registration order (a plugin's ``DPScheme`` subclass is its own description)."""
    return {**BUILTIN_KINDS, **PLUGIN_DP_SCHEMES}


def describe(kind: str) -> type[DPKind]:
    found = kinds().get(kind)
    if found is None:
        raise ValueError(f"dp.kind = {kind!r} is unknown: choose one of {', '.join(kinds())}")
    return found
