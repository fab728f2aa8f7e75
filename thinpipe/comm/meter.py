"""Byte counters per mesh axis, fed only from the sizes of payloads that actually cross a link."""

from __future__ import annotations

from dataclasses import dataclass, field

# ``rollout``: activations and sampled tokens of generation on the mesh (RL rollouts), beside training's PP bytes
AXES = ("pp_fwd", "pp_bwd", "pp_params", "dp", "anchor", "tied", "rollout")


@dataclass
class ByteMeter:
    totals: dict[str, int] = field(default_factory=lambda: {a: 0 for a in AXES})

    def add(self, axis: str, nbytes: int) -> None:
        if axis not in self.totals:
            raise KeyError(f"unknown axis {axis!r}; axes are {AXES}")
        self.totals[axis] += int(nbytes)

    def snapshot(self) -> dict[str, int]:
        return dict(self.totals)
