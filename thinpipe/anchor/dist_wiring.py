"""The anchor circuit's wiring on the real mesh: an anchor stage rank, and a fast rank's feed.

Both ends of a stage's pull and push links (their own process groups, ``comm/groups.py``); the
anchor row's PP links are shaped like the fast rows' (``comm/shaped.py: MeshLinks``).
"""

from __future__ import annotations

import torch

from thinpipe.anchor.dist_rank import AnchorStageRank
from thinpipe.anchor.feed import AnchorFeed
from thinpipe.boundary import Boundary
from thinpipe.comm.dist_group import DistGroup
from thinpipe.comm.dist_transport import DistTransport, job_wire
from thinpipe.comm.groups import ProcessGroups
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.shaped import MeshLinks
from thinpipe.config import Config
from thinpipe.config.env import dist_timeout_s
from thinpipe.placement import device_of
from thinpipe.rank.from_config import anchor_batches
from thinpipe.rank.worker import StageWorker


def anchor_transports(layout, me: int, stage: int, groups: ProcessGroups, meter: ByteMeter, links: MeshLinks,
                      device: torch.device, wire: dict):
    """(pull, push) transports of ``stage``'s anchor links; the pull side sends in the background.
    ``wire``: the job key and ``wire.encrypt`` (``comm/dist_transport.py: job_wire``)."""
    pull = DistTransport(layout, me, meter, links.anchor, group=groups.pull[stage], background=True, device=device,
                         label="anchor-pull", **wire)
    push = DistTransport(layout, me, meter, links.anchor, group=groups.push[stage], device=device,
                         label="anchor-push", **wire)
    return pull, push


def anchor_stage_rank(cfg: Config, stage, layout, me: int, groups: ProcessGroups, meter: ByteMeter, links: MeshLinks,
                      wire_dtype, compute_dtype, train_ds, hidden: int, vocab: int, folder=None) -> AnchorStageRank:
    """An anchor replica's stage process: dense boundaries, its PP traffic on the ``anchor`` axis
    over the anchor row's links (shaped like the fast rows'), its own data shard (SFT; DPO's and GSPO's rows
    come with the pulls, their token ids below ``vocab``); its checkpoint parts in ``folder`` (the run's
    ``checkpoint/``)."""
    m, s = cfg.mesh, stage.index
    dense = [Boundary(b, hidden, wire_dtype) for b in range(m.pp - 1)]
    device = device_of(stage)
    wire = job_wire(cfg.wire.encrypt, "the anchor circuit")
    row = DistTransport(layout, me, meter, lambda axis, peer: links.pp("pp_fwd", peer), group=groups.anchor_row,
                        device=device, label="anchor-row", **wire)
    worker = StageWorker(stage, m.dp, dense[s - 1] if s else None, dense[s] if s < m.pp - 1 else None, row,
                         compute_dtype, axes=("anchor", "anchor"))
    pull, push = anchor_transports(layout, me, s, groups, meter, links, device, wire)
    return AnchorStageRank(cfg, stage, worker, layout, me, pull, push, row, meter, wire_dtype,
                           lambda cycles: anchor_batches(cfg, train_ds, cycles), vocab, folder)


def anchor_feed(cfg: Config, stage, replica: int, layout, me: int, groups: ProcessGroups, meter: ByteMeter,
                links: MeshLinks, wire_dtype) -> AnchorFeed:
    """A fast rank's end of its stage's anchor links."""
    pull, push = anchor_transports(layout, me, stage.index, groups, meter, links, device_of(stage),
                                   job_wire(cfg.wire.encrypt, "the anchor circuit"))
    control = DistGroup(groups.dp[stage.index], cfg.mesh.dp, meter, None)

    def agree(count: int) -> int:
        # ``arrival``: every replica of this stage takes the same priors at the same step.
        _, counts = control.all_gather(replica, torch.tensor([count]))
        return int(min(c.item() for c in counts))

    timeout_s = dist_timeout_s()
    return AnchorFeed(cfg, stage, replica, pull, push, meter, wire_dtype, agree, wait_timeout_s=max(timeout_s, 600.0))
