"""The three interfaces a rank talks through, so that one rank runs unchanged in both engines.

A rank (``rank/``), the anchor circuit and the DP algorithms (``dp/``) never call torch.distributed:
they call a ``Transport`` for point-to-point payloads, a ``Group`` for collectives, and wait on the
``Work`` a collective returns. The simulation implements them in one process (``inprocess.py``:
``Mailbox``, ``InProcessGroup``, ``LocalGroup``), the real mesh over torch.distributed
(``dist_transport.py: DistTransport``, ``dist_group.py: DistGroup``) and across elastic replicas
over torchft (``managed.py: ManagedGroup``); since each engine runs the same rank code over its own
implementation, the simulation's arithmetic and metered bytes are the real mesh's
(docs/architecture.md). tests/architecture/test_comm_protocols.py checks every implementation against these.

Only what the rank core calls is here. A ``DistTransport`` offers more to its engine and the anchor
circuit (``send(..., metered=)``, ``idle()``, ``close()``, ``header_bytes``): those callers hold a
``DistTransport`` itself. torchft's ``CheckpointTransport`` (``recovery.py: SafeTransport``) is a
different interface, torchft's own, for a joining replica's state.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from thinpipe.comm.header import Expect
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import Tag


@runtime_checkable
class Work(Protocol):
    """A posted collective. Posting and waiting are apart so that a rank can compute while its
    collective is on the wire (Streaming DiLoCo's overlap, docs/dp.md), and so that the simulation
    can post every virtual rank's collective before any rank waits (``drive_lockstep``)."""

    def wait(self) -> None:
        """Block until the collective's result is in the caller's tensors (for a GPU rank: copied
        back to its device). The in-process group raises instead when a member has not posted yet:
        that is a schedule bug, which a real group would turn into a deadlock."""

    def is_completed(self) -> bool:
        """Whether ``wait`` would return at once, without blocking (a shaped group's modelled
        transfer included), for a wrapper to forward the question to the collective it wraps."""


@runtime_checkable
class Transport(Protocol):
    """Point-to-point payloads between ranks, named by typed tags (``tags.py``): a tag names its
    peer and its channel, so the kinds of message never cross and any other tag is refused."""

    def send(self, tag: Tag, payload: Payload, axis: str | None) -> None:
        """Hand ``payload`` over for the peer of ``tag`` and meter its bytes on ``axis`` (None: not
        metered, e.g. evaluation passes). It does not wait for the peer: two neighbours that send to
        each other at the same time (1F1B) must not deadlock."""

    def recv(self, tag: Tag, expect: Expect) -> Payload:
        """The payload of ``tag`` from its peer, blocking until it is there. ``expect`` is what the
        receiver accepts: anything else is refused before it is allocated (docs/security.md); the
        simulation checks it too, so every simulated run shows the receivers' bounds admit what
        their senders send."""

    def flush(self) -> None:
        """Wait until every send handed over so far has left, so that a pass or a run can end
        without a message still in flight (the in-process mailbox delivers at once)."""


@runtime_checkable
class Group(Protocol):
    """Collectives over the members of one group (a stage's DP group, a replica's PP control group).
    Each call posts the collective and returns its ``Work``; ``rank`` is the caller's index in the
    group (the in-process group needs it to tell its virtual members apart)."""

    size: int
    """Members now: the DP averages divide by it (across elastic replicas, those in the quorum)."""

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> Work:
        """Post the sum of ``tensor`` over the members, in place, in member order (so every member
        holds the same bits); the result is there once the returned ``Work`` is waited on."""

    def all_gather(self, rank: int, tensor: torch.Tensor, max_numel: int | None = None
                   ) -> tuple[Work, list[torch.Tensor]]:
        """Every member's ``tensor`` in member order, for what cannot be summed (int8 outer
        gradients, the gradient norms of a global clip). ``max_numel``: the most elements a member
        may contribute (default: as many as the caller's), checked before anything is allocated;
        the list is filled by the time the ``Work`` is waited on."""
