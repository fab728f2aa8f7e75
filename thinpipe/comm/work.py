"""The one ``Work`` that is finished when it is made: ``DONE``.

Where nothing is on the wire there is still a ``Work`` to hand over: a group of one (its collective
is the identity), a collective that has completed by the time it returns (``DistGroup.all_gather``),
and the points where a rank's phase lets the other ranks catch up (a phase yields ``DONE`` so that
the simulation advances every rank to the same point before any rank goes on, ``drive_lockstep``).
"""

from __future__ import annotations

from thinpipe.comm.protocols import Work


class Done(Work):
    """A ``Work`` already complete: waiting returns at once."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


DONE = Done()
