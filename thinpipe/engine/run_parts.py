"""A run's checkpoint from any engine, as the simulation's mesh state (docs/data.md, "A run's model").

Three engines write a run folder's ``checkpoint/step{N}/`` differently (``thinpipe/checkpoint.py``):

- the simulation: one part ``mesh`` (``SimMesh.state_dict``);
- ``--engine dist``: one part ``rank{r}`` per process, each written by its own process on its own machine,
  so that a job across machines leaves each machine's ``--out`` with its own ranks' parts only;
- elastic replicas (``launch --elastic``): a run folder per replica and restart (``replica{r}[-restart{a}]/``),
  each like a dist run of one replica (``rank{s}`` per stage).

``read_parts`` finds the newest step whose fast ranks' parts all verify, in one or several folders (a job's
machines' folders), and ``mesh_state`` turns them into the state ``SimMesh.load_state_dict`` takes: a rank's
part holds the same ``StageRank`` state a simulated rank saves, and a boundary's two ends hold one boundary
object's state between them (dist == sim is tested bitwise, so the mesh loaded from parts is the one the
simulation of the same job ends with). The anchor circuit's parts are not read: they hold no weights of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from thinpipe.boundary.base import Boundary
from thinpipe.checkpoint import load_part, sets
from thinpipe.config import ConfigError
from thinpipe.layout import MeshLayout

REPLICA_FOLDER = "replica"  # elastic: OUT/replica{r}[-restart{a}]/ (engine/elastic_setup.py: replica_folder)


@dataclass
class Parts:
    """The fast ranks' parts of one checkpoint set: ``parts[row][stage]`` is that rank's saved state, ``where``
    the set folder each came from (for messages), ``engine`` "dist" or "elastic"."""

    step: int
    parts: list[list[dict]]
    engine: str
    where: list[Path] = field(default_factory=list)


def _describe(layout: MeshLayout, rank: int) -> str:
    role = layout.role(rank)
    return f"rank {rank} (replica {role.replica}, stage {role.stage})"


def _part_sets(folder: Path, names: list[str]) -> dict[int, dict[str, Path]]:
    """step -> {part name: set folder} for the parts among ``names`` that are complete (their digest file
    written last) under ``folder/checkpoint``."""
    out: dict[int, dict[str, Path]] = {}
    for step, d in sets(folder / "checkpoint"):
        for n in names:
            if (d / f"{n}.sha256").is_file():
                out.setdefault(step, {})[n] = d
    return out


def has_parts(folder: Path) -> bool:
    """Whether ``folder`` holds parts of a dist job (``rank{r}``) or an elastic job's replica folders."""
    for _, d in sets(folder / "checkpoint"):
        if any(d.glob("rank*.sha256")):
            return True
    return any(p.is_dir() and p.name.startswith(REPLICA_FOLDER) for p in folder.iterdir()) if folder.is_dir() else False


def _dist_parts(folders: list[Path], layout: MeshLayout) -> Parts:
    """The newest step at which every fast rank's part is complete in one of ``folders``."""
    fast = [f"rank{r}" for r in range(layout.dp * layout.pp)]
    found: dict[int, dict[str, Path]] = {}
    for folder in folders:
        for step, held in _part_sets(folder, fast).items():
            for name, d in held.items():
                found.setdefault(step, {}).setdefault(name, d)
    complete = [s for s, held in found.items() if len(held) == len(fast)]
    if not complete:
        if not found:
            raise ConfigError(f"{', '.join(map(str, folders))} hold{'s' if len(folders) == 1 else ''} no checkpoint "
                              "part of the job's ranks (checkpoint/step*/rank*.*): the job wrote none yet")
        step = max(found)
        missing = [int(n[4:]) for n in fast if n not in found[step]]
        listed = "; ".join(_describe(layout, r) for r in missing[:4]) + ("; ..." if len(missing) > 4 else "")
        raise ConfigError(f"the checkpoint of step {step} lacks the parts of {len(missing)} rank"
                          f"{'s' if len(missing) != 1 else ''}: {listed}; each is checkpoint/step{step:08d}/rank<r>.* "
                          "in the --out folder of the machine that ran it: give that folder too (--run A --run B ...)")
    step = max(complete)
    held = found[step]
    grid = [[load_part(held[f"rank{layout.grid[row][s]}"], f"rank{layout.grid[row][s]}") for s in range(layout.pp)]
            for row in range(layout.dp)]
    _check_one_job(grid, layout, held)
    return Parts(step, grid, "dist", sorted(set(held.values())))


def _check_one_job(grid: list[list[dict]], layout: MeshLayout, held: dict[str, Path]) -> None:
    """Every part of one set was written by one job: its world size, the role it names, and (when the parts
    carry one) the job's identity."""
    jobs: dict[str, str] = {}
    for row in grid:
        for part in row:
            role = part.get("role", {})
            rank = role.get("rank")
            where = held.get(f"rank{rank}", "?")
            if part.get("world_size") != layout.world_size:
                raise ConfigError(f"{where}: rank {rank}'s part was written by a job of {part.get('world_size')} "
                                  f"ranks, not this run's {layout.world_size}: the folders hold parts of different "
                                  "jobs")
            if "job" in part:
                jobs.setdefault(part["job"], str(where))
    if len(jobs) > 1:
        (a, fa), (b, fb) = list(jobs.items())[:2]
        raise ConfigError(f"the parts come from different jobs ({fa} from job {a}, {fb} from job {b}): give the "
                          "folders of one job")


def _elastic_parts(folder: Path, layout: MeshLayout) -> Parts:
    """An elastic job's model: the replica folder with the newest complete set (every replica holds the same
    synchronised model, docs/elastic.md), its stages in every row."""
    best: tuple[int, Path] | None = None
    names = [f"rank{s}" for s in range(layout.pp)]
    for d in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith(REPLICA_FOLDER)):
        for step, held in _part_sets(d, names).items():
            if len(held) == len(names) and (best is None or step > best[0]):
                best = (step, d)  # a tie: the first folder in name order
    if best is None:
        raise ConfigError(f"{folder} holds no replica folder with a complete checkpoint (replica*/checkpoint/step*/"
                          f"rank0..rank{layout.pp - 1}): the job wrote none yet")
    step, d = best
    row = [load_part(d / "checkpoint" / f"step{step:08d}", n) for n in names]
    return Parts(step, [row for _ in range(layout.dp)], "elastic", [d / "checkpoint" / f"step{step:08d}"])


def read_parts(folders: list[Path], dp: int, pp: int, anchor: int = 0) -> Parts:
    """The fast ranks' parts of the newest complete set of a dist job (``folders``: its machines' --out folders,
    one or several) or of an elastic job (one folder holding ``replica*/``)."""
    layout = MeshLayout(dp, pp, anchor)
    replicas = [f for f in folders if f.is_dir() and any(p.name.startswith(REPLICA_FOLDER) for p in f.iterdir()
                                                           if p.is_dir())]
    if replicas:
        if len(folders) > 1:
            raise ConfigError(f"{replicas[0]} is an elastic job's folder (replica*/): give it alone, it holds every "
                              "replica's checkpoints")
        return _elastic_parts(replicas[0], layout)
    return _dist_parts(folders, layout)


def mesh_state(parts: Parts, boundaries: list[Boundary]) -> dict:
    """``SimMesh.load_state_dict``'s state (its anchor circuit left out) from the fast ranks' parts; ``boundaries``:
    a replica's boundaries as built (``Boundary.merged_state``: which end keeps what)."""
    grid = parts.parts
    return {"step": parts.step, "ranks": [[p["rank"] for p in row] for row in grid], "bytes": {},
            "priors_consumed": 0, "anchor": None,
            "boundaries": [[b.merged_state(row[b.index].get("boundaries", {}).get(b.index, {}),
                                           row[b.index + 1].get("boundaries", {}).get(b.index, {})) for b in boundaries]
                           for row in grid]}
