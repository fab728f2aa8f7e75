"""How fast a compressed run learns against Dense (issue 52, item 5): the frontier's ``learning_ratio``.

A codec can end above Dense because it learns slower (every step is worth less) or because it plateaus (a floor
its error sets). The learning ratio separates them at the end: the first step at which the Dense run of the same
seed and length reaches the arm's final held-out loss, divided by the arm's steps. 0.6 means the arm's whole run
bought what Dense had after 60% of it; 1 (or None: Dense never gets there, the arm ends at or below Dense) means
no loss of learning at all.
"""

from __future__ import annotations

from collections.abc import Sequence


def learning_ratio(reference: Sequence[tuple[float, float]], final_loss: float, steps: int) -> float | None:
    """The first step at which ``reference`` ((step, held-out loss) points, ascending steps: the Dense run) reaches
    ``final_loss``, linearly interpolated between its held-out evaluations, over ``steps``; None when it never
    reaches it."""
    points = sorted((float(s), float(v)) for s, v in reference)
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v0 <= final_loss:
            return s0 / steps
        if v1 <= final_loss:
            return (s0 + (s1 - s0) * (v0 - final_loss) / (v0 - v1)) / steps
    if points and points[-1][1] <= final_loss:
        return points[-1][0] / steps
    return None
