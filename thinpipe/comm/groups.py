"""Every torch.distributed process group of the mesh, built once from its grid (picotron style).

torch.distributed requires every process to create every group, in the same order; ``build`` does
that from ``MeshLayout`` alone, so no rank negotiates anything, and the result is frozen: code
that needs a group takes it from here instead of creating one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from thinpipe.layout import MeshLayout

# Anchor links wait as long as an anchor cycle may take, not the fast circuit's collective timeout.
ANCHOR_TIMEOUT_S = 24 * 3600


@dataclass(frozen=True)
class ProcessGroups:
    dp: tuple        # per stage: that stage's ranks of every fast replica (DP syncs)
    pp: tuple        # per row (fast replicas, then the anchor's): its stages (clip norms)
    fast: dist.ProcessGroup  # every fast rank: losses, held-out loss, checkpoints (never the anchor's ranks)
    pull: tuple      # per stage, with an anchor: {fast replica 0's stage s, anchor stage s}
    push: tuple      # per stage, with an anchor: {every fast replica's stage s, anchor stage s}
    anchor_row: dist.ProcessGroup | None  # the anchor replica's stages

    @staticmethod
    def build(layout: MeshLayout) -> ProcessGroups:
        dp = tuple(dist.new_group(layout.dp_ranks(s)) for s in range(layout.pp))
        pp = tuple(dist.new_group(layout.pp_ranks(r)) for r in range(layout.rows))
        fast = dist.new_group([r for row in range(layout.dp) for r in layout.grid[row]])
        pull, push, row = (), (), None
        if layout.anchor:
            long = datetime.timedelta(seconds=ANCHOR_TIMEOUT_S)
            grid, a = layout.grid, layout.dp
            pull = tuple(dist.new_group([grid[0][s], grid[a][s]], timeout=long) for s in range(layout.pp))
            push = tuple(dist.new_group([grid[r][s] for r in range(layout.dp)] + [grid[a][s]], timeout=long)
                         for s in range(layout.pp))
            row = dist.new_group(grid[a], timeout=long)
        return ProcessGroups(dp, pp, fast, pull, push, row)
