"""Where a rank's step time goes (issue 54): its compute, its waits on each neighbour, and the test hook that slows it.

``StageWorker`` adds to a ``StepTimes`` around what it does: the stage's forward or backward with its boundaries'
encode and decode (compute), and a blocking receive from the previous stage (an activation) or the next (a
gradient) (waits). The engine reads it once per step (``take``) into ``ranks.jsonl`` (``engine/rank_rows.py``).

``THINPIPE_SLOW_RANK=r:factor`` (``faults.py``) makes global rank r's compute take ``factor`` times as long, in
training and in ``mesh.split = "auto"``'s start-up measurement alike: after each timed piece of compute it sleeps
``(factor - 1)`` times what the piece took, so a slowed rank looks, to its neighbours and to itself, like a slower
GPU (the emulated uneven mesh of ``benchmarks/uneven_split.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Seconds of one step on one rank."""

    compute_s: float = 0.0
    """Forward and backward of the stage and its boundaries (a slowed rank's sleep included)."""
    wait_s: dict[str, float] = field(default_factory=dict)
    """Blocked on a receive, per neighbour: ``prev`` (activations) and ``next`` (gradients)."""
    slow: float = 1.0
    """The ``THINPIPE_SLOW_RANK`` factor of this rank (1: not slowed)."""

    @contextmanager
    def compute(self):
        t0 = time.perf_counter()
        yield
        took = time.perf_counter() - t0
        if self.slow > 1.0:
            time.sleep(took * (self.slow - 1.0))
            took *= self.slow
        self.compute_s += took

    @contextmanager
    def waiting(self, neighbour: str):
        t0 = time.perf_counter()
        yield
        self.wait_s[neighbour] = self.wait_s.get(neighbour, 0.0) + time.perf_counter() - t0

    def take(self) -> tuple[float, float, float]:
        """(compute, wait on prev, wait on next) since the last call; the counters start again."""
        out = (self.compute_s, self.wait_s.get("prev", 0.0), self.wait_s.get("next", 0.0))
        self.compute_s, self.wait_s = 0.0, {}
        return out

