"""In-process transport for the single-process mesh simulation.

``Mailbox`` carries PP payloads between stages; ``InProcessGroup`` is a collective over virtual
ranks: each member posts its tensor and gets a ``Work``; when the last member has posted, the
reduction runs in rank order (so it is deterministic) and every member's tensor holds the result.
A member that waits before all have posted is a schedule bug and raises, instead of deadlocking.
"""

from __future__ import annotations

import torch

from thinpipe.comm import protocols
from thinpipe.comm.header import Expect, PayloadError, spec_of
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import Tag, check_tag


class Work(protocols.Work):
    """An in-process collective's ``Work``: complete once the last member has posted."""

    def __init__(self) -> None:
        self._done = False

    def is_completed(self) -> bool:
        return self._done

    def wait(self) -> None:
        if not self._done:
            raise RuntimeError("in-process collective waited on before every member posted (schedule bug)")


class LocalGroup(protocols.Group):
    """A group of one: collectives are the identity (used to run group algorithms on one worker)."""

    size = 1

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> Work:
        work = Work()
        work._done = True
        return work

    def all_gather(self, rank: int, tensor: torch.Tensor, max_numel: int | None = None
                   ) -> tuple[Work, list[torch.Tensor]]:
        return self.all_reduce(rank, tensor), [tensor]


class InProcessGroup(protocols.Group):
    """``axis`` None: a control group (e.g. gradient norms for clipping) whose few bytes are not metered."""

    def __init__(self, size: int, meter: ByteMeter, axis: str | None):
        self.size, self.meter, self.axis = size, meter, axis
        self._pending: dict[int, tuple[torch.Tensor, Work]] = {}
        self._gather: dict[tuple, tuple] = {}

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> Work:
        """Sum over members, in place. Metered as a ring all-reduce: 2 (n-1)/n of the tensor per member."""
        if rank in self._pending:
            raise RuntimeError(f"rank {rank} posted twice to the same collective")
        work = Work()
        self._pending[rank] = (tensor, work)
        n = self.size
        if self.axis is not None:
            self.meter.add(self.axis, 2 * (n - 1) * tensor.numel() * tensor.element_size() // n)
        if len(self._pending) == n:
            members = [self._pending[r] for r in range(n)]
            total = members[0][0].clone()
            for t, _ in members[1:]:
                total += t
            for t, w in members:
                t.copy_(total)
                w._done = True
            self._pending.clear()
        return work


    def all_gather(self, rank: int, tensor: torch.Tensor, max_numel: int | None = None
                   ) -> tuple[Work, list[torch.Tensor]]:
        """Every member's tensor, in rank order (filled when the last member has posted). Metered
        as a ring all-gather: (n-1) x the tensor per member. ``max_numel`` as in the real group's
        (checked against the member's own tensor here, so the simulation shows the bounds hold)."""
        if max_numel is not None and tensor.numel() > max_numel:
            raise PayloadError(f"all-gather: member {rank} contributes {tensor.numel()} elements, more than the "
                               f"{max_numel} its peers accept")
        key = ("gather", rank)
        if key in self._gather:
            raise RuntimeError(f"rank {rank} posted twice to the same all-gather")
        work = Work()
        out: list[torch.Tensor] = []
        self._gather[key] = (tensor.clone(), work, out)
        if self.axis is not None:
            self.meter.add(self.axis, (self.size - 1) * tensor.numel() * tensor.element_size())
        if len(self._gather) == self.size:
            members = [self._gather[("gather", r)] for r in range(self.size)]
            for _, w, o in members:
                o.extend(t for t, _, _ in members)
                w._done = True
            self._gather.clear()
        return work, out


class Mailbox(protocols.Transport):
    """Point-to-point payload delivery between stages, metered on the given axis."""

    def __init__(self, meter: ByteMeter):
        self.meter = meter
        self._box: dict[Tag, Payload] = {}

    def send(self, tag: Tag, payload: Payload, axis: str | None) -> None:
        check_tag(tag)
        if tag in self._box:
            raise RuntimeError(f"payload {tag} sent twice")
        if axis is not None:
            self.meter.add(axis, payload.nbytes)
        self._box[tag] = payload

    def recv(self, tag: Tag, expect: Expect) -> Payload:
        """As the real transport: ``expect`` is checked here too, so every simulated run shows that the
        receivers' bounds admit what their senders send."""
        check_tag(tag)
        try:
            payload = self._box.pop(tag)
        except KeyError:
            raise RuntimeError(f"payload {tag} received before it was sent (schedule bug)") from None
        expect.check(spec_of(payload), f"{type(tag).__name__} (simulated)")
        return payload

    def flush(self) -> None:
        """Every send is delivered at once (the real transport's flush waits for its sends)."""


def drive_lockstep(gens) -> None:
    """Run several virtual ranks' collective generators (each yields a ``Work`` per collective)
    in lockstep: every rank posts its collective before any rank waits, as real ranks would."""
    gens = list(gens)
    while gens:
        posted = []
        for g in gens:
            try:
                posted.append((g, next(g)))
            except StopIteration:
                continue
        for _, work in posted:
            work.wait()
        gens = [g for g, _ in posted]
