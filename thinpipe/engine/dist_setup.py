"""What every process of a real mesh does before it becomes a rank: check the config, build its stage,
boundaries, data and groups (``RankSetup``), agree with the others on the checkpoint set to resume from,
and watch its launcher.

``engine/dist_engine.py`` (a fast rank) and ``engine/elastic_rank.py`` (a rank of an elastic replica) both start
here; an anchor rank is built by ``anchor_rank`` (``anchor/dist_rank.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from thinpipe.anchor.dist_rank import AnchorStageRank
from thinpipe.anchor.dist_wiring import anchor_stage_rank
from thinpipe.boundary import build_boundaries
from thinpipe.checkpoint import load_part, refuse_legacy, sets, step_dir, verifies
from thinpipe.comm.groups import ProcessGroups
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.shaped import MeshLinks
from thinpipe.config import Config, ConfigError
from thinpipe.data import PackedDataset
from thinpipe.faults import bench_whole_model
from thinpipe.layout import MeshLayout, Role
from thinpipe.models import Stage
from thinpipe.objective.registry import build_data
from thinpipe.placement import local_rank, move
from thinpipe.rank.from_config import DTYPES, load_stage, place, wire_dtype
from thinpipe.rank.schedule import SCHEDULES
from thinpipe.rank.split_measure import agree_split

KEEP_LISTED = 64  # how many of its newest verified sets a rank reports when ranks agree on one to resume


def check_supported(cfg: Config) -> None:
    if cfg.diag.every:
        raise ConfigError("--engine dist does not compute gradient diagnostics: set diag.every = 0")


@dataclass(frozen=True)
class RankSetup:
    """What every process of the mesh builds the same way before it becomes a fast or an anchor rank."""

    cfg: Config
    layout: MeshLayout
    role: Role
    groups: ProcessGroups
    links: MeshLinks
    stage: Stage
    bounds: list            # every boundary of the pipeline (this process touches its stage's two)
    train_ds: PackedDataset
    val_ds: PackedDataset
    hidden_size: int
    actions: list           # this stage's row of the pipeline schedule
    device: torch.device    # where this rank computes
    tokenizer: object = None  # the model's (an objective may decode what it samples with it)
    vocab_size: int = 0       # the model's vocabulary (what token ids a peer sends may index)
    split_auto: dict | None = None  # mesh.split = "auto": the measurements and the split chosen (summary.json)

    @staticmethod
    def build(cfg: Config, layout: MeshLayout | None = None) -> RankSetup:
        """``layout``: the processes of this torch.distributed world (default: the whole mesh; an
        elastic replica's world is its own pipeline row, ``engine/elastic_rank.py``)."""
        t, m = cfg.train, cfg.mesh
        layout = layout or MeshLayout(m.dp, m.pp, m.anchor)
        layout.check_world(dist.get_world_size())
        role = layout.role(dist.get_rank())
        device = place(cfg, local_rank())
        # mesh.split = "auto": measured and agreed before any stage loads (rank/split_measure.py); cfg then holds it
        split_auto = agree_split(cfg, layout, role, device) if m.split == "auto" else None
        # Only this rank's stage holds weights (the others are placeholders boundaries attach to);
        loaded = load_stage(cfg, role.stage, whole=bench_whole_model())  # benchmarks/stage_memory.py's "before"
        train_ds, val_ds = build_data(cfg, loaded.tokenizer)
        stages, hidden = loaded.stages, loaded.hidden_size
        bounds = build_boundaries(cfg.boundary, m.pp, hidden, t.seed, wire_dtype(cfg), loaded.model)
        for b in bounds:
            b.attach(stages[b.index], stages[b.index + 1])
        for module in [stages[role.stage], *bounds]:
            move(module, device)  # after attach: the owned boundary modules move with their stage
        groups = ProcessGroups.build(layout)  # every process, every group, the same order
        links = MeshLinks(cfg.link, lambda rank: layout.role(rank).stage, role.rank)  # a PP link: its boundary's
        return RankSetup(cfg, layout, role, groups, links, stages[role.stage], bounds, train_ds, val_ds,
                         hidden, SCHEDULES[t.schedule](m.pp, t.microbatches)[role.stage], device, loaded.tokenizer,
                         loaded.model.config.vocab_size, split_auto)


def held_state(state: dict) -> dict:
    """A boundary's state without the neighbouring stage's placeholders (meta tensors: this rank
    builds only its own stage, ``setup.load_stage``); they hold no data and are not this rank's."""
    return {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.is_meta)}


def anchor_rank(r: RankSetup, folder: Path) -> AnchorStageRank:
    return anchor_stage_rank(r.cfg, r.stage, r.layout, r.role.rank, r.groups, ByteMeter(), r.links,
                             wire_dtype(r.cfg), DTYPES[r.cfg.train.dtype], r.train_ds, r.hidden_size, r.vocab_size,
                             folder)


def agreed_set(folder: Path, rank: int, world_size: int, group=None, members: int | None = None) -> tuple[int, dict]:
    """(step, this rank's state) of the newest set whose part verifies on every rank of the job, the
    anchor's included (one collective over all ranks: each reports its newest verified steps). A rollback
    agrees over the fast ranks alone (``group``, of ``members`` ranks): the anchor ranks are busy with their
    cycles, and a set the fast ranks completed holds the anchor's parts (they are written before the fast
    ranks' barrier)."""
    mine = [s for s, f in sets(folder) if verifies(f, [f"rank{rank}"])][:KEEP_LISTED]
    t = torch.full((KEEP_LISTED,), -1, dtype=torch.int64)
    t[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(members or world_size)]
    dist.all_gather(out, t, group=group)
    common = set.intersection(*({int(x) for x in o.tolist()} for o in out)) - {-1}
    if not common:
        refuse_legacy(folder)
        raise ConfigError(f"--resume: no checkpoint in {folder} is complete on all {world_size} ranks (a set written "
                          "after an anchor rank failed holds no part of it); start without --resume")
    step = max(common)
    state = load_part(step_dir(folder, step), f"rank{rank}")
    if state["world_size"] != world_size:
        raise ConfigError(f"--resume: the checkpoint was written by {state['world_size']} ranks, this job has "
                          f"{world_size}")
    return step, state


