"""The mesh's ranks: (fast replicas + anchor replicas) x stages, one grid (picotron style).

``grid[row][stage]`` is a global rank; rows 0..dp-1 are the fast circuit's replicas, the rows after
them the anchor circuit's. Every process derives the same grid from the config, so roles, DP groups
(one per stage, over the fast rows) and PP groups (one per row) need no negotiation.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config import ConfigError


@dataclass(frozen=True)
class Role:
    rank: int
    circuit: str   # "fast" or "anchor"
    replica: int   # row in the grid
    stage: int


class MeshLayout:
    def __init__(self, dp: int, pp: int, anchor: int = 0):
        self.dp, self.pp, self.anchor = dp, pp, anchor
        self.rows = dp + anchor
        self.grid = [[row * pp + s for s in range(pp)] for row in range(self.rows)]

    @property
    def world_size(self) -> int:
        return self.rows * self.pp

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(f"the mesh mesh.dp = {self.dp} x mesh.pp = {self.pp} (+ mesh.anchor = {self.anchor} "
                              f"anchor replica{'s' if self.anchor != 1 else ''}) needs {self.world_size} processes, "
                              f"but {world_size} were started: run torchrun --nproc-per-node {self.world_size} "
                              "(or change mesh.dp / mesh.pp)")

    def role(self, rank: int) -> Role:
        row, stage = divmod(rank, self.pp)
        return Role(rank, "fast" if row < self.dp else "anchor", row, stage)

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.grid[r][stage] for r in range(self.dp)]

    def pp_ranks(self, row: int) -> list[int]:
        return list(self.grid[row])
