"""Typed message tags: one small frozen type per kind of message, naming its channel and its link.

Every point-to-point message of the mesh carries one of these as its tag. The type fixes the
torch.distributed tag (``CHANNEL``: kinds of message never cross on one link) and ``ends(layout)``
names the two global ranks of the link it travels (``peer`` is the other end from the caller's),
so routing is written once, here, for both transports. Transports refuse anything that is not one
of ``TAG_TYPES``: a malformed tag fails in the simulation as it would on the real mesh.

Rows of the grid (``mesh.MeshLayout``): 0..dp-1 are the fast replicas, row dp the anchor replica.
A tag's ``replica`` is a row (the anchor circuit's own pipeline uses row dp); the simulation's
gradient diagnostics use row -1, which exists only in the in-process mailbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class Tag:
    CHANNEL: ClassVar[int]

    def ends(self, layout) -> tuple[int, int]:
        raise NotImplementedError

    def peer(self, layout, me: int) -> int:
        a, b = self.ends(layout)
        if me not in (a, b):
            raise ValueError(f"rank {me} is not an end of {self} (its link joins ranks {a} and {b})")
        return b if me == a else a


@dataclass(frozen=True)
class _Boundary(Tag):
    """A message across boundary ``boundary`` of row ``replica`` (stage b -> b + 1 or back)."""

    replica: int
    boundary: int

    def ends(self, layout) -> tuple[int, int]:
        row = layout.grid[self.replica]
        return row[self.boundary], row[self.boundary + 1]


@dataclass(frozen=True)
class Activation(_Boundary):
    """Forward payload of microbatch ``microbatch`` (PP forward)."""

    microbatch: int
    CHANNEL: ClassVar[int] = 1


@dataclass(frozen=True)
class Gradient(_Boundary):
    """Backward payload of microbatch ``microbatch`` (PP backward)."""

    microbatch: int
    CHANNEL: ClassVar[int] = 2


@dataclass(frozen=True)
class ParamGrads(_Boundary):
    """Receiver -> owner: gradient contributions to shared boundary parameters."""

    CHANNEL: ClassVar[int] = 3


@dataclass(frozen=True)
class Params(_Boundary):
    """Owner -> receiver: the shared boundary parameters after the optimizer step."""

    CHANNEL: ClassVar[int] = 4


@dataclass(frozen=True)
class TiedGrad(Tag):
    """One half of the tied-embedding gradient exchange between the first and last stage of a row;
    ``to_first`` names the receiving end so the two messages stay distinct."""

    replica: int
    to_first: bool
    CHANNEL: ClassVar[int] = 5

    def ends(self, layout) -> tuple[int, int]:
        row = layout.grid[self.replica]
        return row[0], row[-1]


@dataclass(frozen=True)
class EvalActivation(_Boundary):
    """An evaluation or analysis pass (held-out loss, residuals): ``key`` names the batch."""

    key: tuple
    CHANNEL: ClassVar[int] = 6


@dataclass(frozen=True)
class AnchorCycle(Tag):
    """Anchor stage ``boundary`` -> ``boundary + 1``: which cycle (fast step) runs next."""

    boundary: int
    CHANNEL: ClassVar[int] = 7

    def ends(self, layout) -> tuple[int, int]:
        row = layout.grid[layout.dp]
        return row[self.boundary], row[self.boundary + 1]


@dataclass(frozen=True)
class Pull(Tag):
    """Fast replica 0's stage ``stage`` -> anchor stage ``stage``: the weights w_t (or a stop)."""

    stage: int
    CHANNEL: ClassVar[int] = 8

    def ends(self, layout) -> tuple[int, int]:
        return layout.grid[0][self.stage], layout.grid[layout.dp][self.stage]


@dataclass(frozen=True)
class Push(Tag):
    """Anchor stage ``stage`` -> fast replica ``replica``'s stage ``stage``: an anchor prior (or the end)."""

    replica: int
    stage: int
    CHANNEL: ClassVar[int] = 9

    def ends(self, layout) -> tuple[int, int]:
        return layout.grid[layout.dp][self.stage], layout.grid[self.replica][self.stage]


@dataclass(frozen=True)
class RefreshUp(_Boundary):
    """Stage b + 1 -> b: the refresh contributions of the stages after b (a boundary's stage state)."""

    CHANNEL: ClassVar[int] = 10


@dataclass(frozen=True)
class RefreshDown(_Boundary):
    """Stage b -> b + 1: the refreshed stage state."""

    CHANNEL: ClassVar[int] = 11


@dataclass(frozen=True)
class SampledTokens(Tag):
    """Generation (``rank/generation.py``): the last stage of row ``replica`` -> its stage ``stage``,
    the tokens one decode round sampled and which rows are done; ``key`` names the pass and the round."""

    replica: int
    stage: int
    key: tuple
    CHANNEL: ClassVar[int] = 12

    def ends(self, layout) -> tuple[int, int]:
        row = layout.grid[self.replica]
        return row[-1], row[self.stage]


@dataclass(frozen=True)
class ModelShare(Tag):
    """The end of a job (``engine/job_model.py``): fast replica 0's stage ``stage`` -> global rank ``to``, that
    stage's share of the job's model."""

    stage: int
    to: int
    CHANNEL: ClassVar[int] = 13

    def ends(self, layout) -> tuple[int, int]:
        return layout.grid[0][self.stage], self.to


TAG_TYPES = (Activation, Gradient, ParamGrads, Params, TiedGrad, EvalActivation, AnchorCycle, Pull, Push, RefreshUp,
             RefreshDown, SampledTokens, ModelShare)
_channels = [t.CHANNEL for t in TAG_TYPES]
assert len(set(_channels)) == len(_channels), "two message kinds share a channel"


def check_tag(tag) -> Tag:
    """The tag itself, or a TypeError naming what is wrong (both transports call this)."""
    if type(tag) not in TAG_TYPES:
        raise TypeError(f"unknown message tag {tag!r}: a message is tagged with one of "
                        f"{', '.join(t.__name__ for t in TAG_TYPES)} (comm/tags.py)")
    return tag
