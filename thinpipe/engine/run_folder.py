"""Run folders: load one back (mesh, merged model), export one.

A run folder holds ``config.toml`` and ``checkpoint/`` (``engine/loop.py`` writes them). Loading rebuilds
the mesh of the run's own config and restores the newest checkpoint that verifies into it: the simulation's,
or a dist or elastic job's ranks' parts (``engine/run_parts.py``; ``thinpipe/checkpoint.py``: safetensors +
JSON, nothing in a run folder can run code).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from thinpipe.checkpoint import latest_complete, refuse_legacy, restoring
from thinpipe.config import Config, ConfigError, load_config
from thinpipe.console import say
from thinpipe.engine.job_model import MODEL_DIR, adapter_only, architectural_line, save_model, write_into
from thinpipe.engine.run_parts import REPLICA_FOLDER, has_parts, mesh_state, read_parts
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import merge_stages
from thinpipe.models.loading import is_random_preset, resolve_model_name, save_weights
from thinpipe.models.lora import merge_lora
from thinpipe.placement import resolve_device
from thinpipe.rank.from_config import load
from thinpipe.runlock import check_out_path


def run_config(runs: list[Path]) -> Config:
    """The config of the job whose folders ``runs`` are: the ``config.toml`` its lead rank wrote (a dist job's
    other machines write none; an elastic job's is in each replica folder), the same in every folder that has
    one."""
    found: list[tuple[Path, bytes]] = []
    for run in runs:
        for f in [run / "config.toml", *sorted(run.glob(f"{REPLICA_FOLDER}*/config.toml"))[:1]]:
            if f.is_file():
                found.append((f, f.read_bytes()))
                break
    if not found:
        where = runs[0] if len(runs) == 1 else ", ".join(map(str, runs))
        raise ConfigError(f"{where} is not a thinpipe run folder (no config.toml): give the --out folder of a "
                          "`thinpipe train` or `thinpipe launch` run (of a job across machines: rank 0's machine's)")
    for f, text in found[1:]:
        if text != found[0][1]:
            raise ConfigError(f"{f} and {found[0][0]} configure different jobs: give the folders of one job")
    return load_config(found[0][0])


def load_mesh(run_dir: str | Path | list, device: str = "cpu"):
    """(config, mesh restored from the run's newest checkpoint on ``device`` (a ``train.device`` value),
    LoadedModel) of a finished or checkpointed run of any engine: the simulation's, a dist job's (its
    ranks' parts, in one folder or in several machines' folders: ``run_dir`` a list) or an elastic job's
    (``engine/run_parts.py``). The checkpoint loads on any device, whatever it trained on."""
    runs = [Path(r) for r in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    cfg = run_config(runs)
    parts = read_parts(runs, cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.anchor) if any(has_parts(r) for r in runs) else None
    found = latest_complete(runs[0] / "checkpoint", "mesh", warn=say) if parts is None and len(runs) == 1 else None
    if parts is None and found is None:
        refuse_legacy(runs[0] / "checkpoint")
        raise ConfigError(f"{', '.join(map(str, runs))} holds no checkpoint (checkpoint/step*/: the simulation's, a "
                          "dist job's ranks' parts or an elastic job's replicas'): the run wrote none yet")
    dev = resolve_device(device)
    loaded = load(cfg)
    mesh = SimMesh(loaded.model, cfg, dev)
    # a dist job's parts: the anchor circuit's hold no weights of the model and are not read
    if parts is not None:
        state = mesh_state(parts, mesh.boundaries)
    else:
        assert found is not None
        state = found[1]["mesh"]
    with restoring(runs[0] / "checkpoint"):  # a hand-edited part whose digests verify: one line
        mesh.load_state_dict(state)
    synchronise(mesh, state["step"])
    return cfg, mesh, loaded


def synchronise(mesh: SimMesh, steps: int) -> None:
    """Replica 0's stages become the job's model, by one rule for every engine: the weights every replica holds
    alike. A DP scheme whose replicas differ between syncs (DiLoCo, Streaming DiLoCo) says which they are (its
    outer weights, ``DPScheme.synchronised``); where replicas must agree after the run's last step (all-reduce,
    PowerSGD), they are checked to."""
    for s, rk in enumerate(mesh.ranks[0]):
        agreed = rk.dp_scheme.synchronised()
        if agreed is not None:
            params = dict(rk.trained())
            with torch.no_grad():
                for name, w in agreed.items():
                    params[name].copy_(w.to(params[name].device))
            continue
        if steps == 0 or not rk.dp_scheme.agree_after(steps - 1):
            continue
        mine = rk.trained()
        for other in mesh.ranks[1:]:
            for (name, p), (_, q) in zip(mine, other[s].trained()):
                if not torch.equal(p, q):
                    raise ConfigError(f"replica {other[s].replica}'s stage {s} differs from replica 0's in {name}, "
                                      f"though dp.kind = {mesh.cfg.dp.kind} keeps every replica alike: the checkpoint "
                                      "does not hold one step of one job")


def load_run(run_dir: str | Path | list, device: str = "cpu", merge: bool = True):
    """(config, Hugging Face model on ``device``, tokenizer) of a finished or checkpointed run (any engine,
    ``load_mesh``); a LoRA run's adapters folded in (``merge``) or left in place (what ``job_model.write_into``
    takes)."""
    cfg, mesh, loaded = load_mesh(run_dir, device)
    if any(b.architectural for b in mesh.boundaries):  # the boundary kind says it is part of the model
        raise ConfigError(f"{run_dir} trained with boundary.kind = {cfg.boundary.kind}, "
                          "whose projectors are part of the model: a plain Hugging Face model would drop them. "
                          "`thinpipe eval --model RUN` evaluates it through its boundaries; "
                          "`thinpipe analyze --run RUN` inspects them")
    model = merge_stages(loaded.model, mesh.replicas[0])
    return cfg, (merge_lora(model) if merge else model).to(mesh.device), loaded.tokenizer


def write_run_model(run_dir: Path) -> Path | None:
    """``RUN/model/``: the job's model read back from its folder (an elastic job's replicas, once they have ended),
    as the other engines write it at their end (``engine/job_model.py``); None (one line says why) for a boundary
    kind that is part of the model."""
    cfg, mesh, loaded = load_mesh(run_dir)
    if any(b.architectural for b in mesh.boundaries):
        say(architectural_line(cfg))
        return None
    dest = Path(run_dir) / MODEL_DIR
    save_model(merge_stages(loaded.model, mesh.replicas[0]), loaded.tokenizer, dest, cfg)
    return dest


def refuse_nested(a: str | Path, b: str | Path, what: str) -> None:
    """Two folders of one command that must not be one inside the other (``what`` names them in the line)."""
    a, b = Path(a).resolve(), Path(b).resolve()
    if a == b:
        raise ConfigError(f"{what} are the same folder ({a}): give another --out")
    if a in b.parents or b in a.parents:
        inner, outer = (b, a) if a in b.parents else (a, b)
        raise ConfigError(f"{what}: {inner} lies inside {outer}; writing one would destroy the other: "
                          "give another --out")


def read_init(src: str | Path, out: str | Path, load: bool = True):
    """What ``train --init-from SRC --out OUT`` starts from, read before --out is claimed (so that
    --overwrite removes nothing until the weights are in hand): a Hugging Face folder (``config.json``)
    as its path, a run folder as its merged (model, tokenizer), or with ``load`` False its path once
    checked. SRC and OUT may not be one inside the other."""
    refuse_nested(src, out, f"--init-from {src} and --out {out}")
    src = Path(src).resolve()
    if (src / "config.json").is_file():
        return src
    if not (src / "config.toml").is_file():
        raise ConfigError(f"--init-from {src}: neither a Hugging Face model folder (config.json) nor a thinpipe run "
                          "folder (config.toml + checkpoint/)")
    if not load:
        return src
    _, model, tokenizer = load_run(src)
    return model, tokenizer


def init_weights(init, dest: str | Path) -> Path:
    """The Hugging Face folder a ``train --init-from`` run loads its weights from: ``init`` of
    ``read_init`` itself when it is a Hugging Face folder, else a run's merged weights (LoRA merged,
    replica 0) exported once into ``dest``. Written to a temporary folder and renamed, so processes of
    one machine (dist ranks) that race here all end with the same complete folder."""
    dest = Path(dest).resolve()
    if isinstance(init, Path) and (init / "config.json").is_file():
        return init
    if (dest / "config.json").is_file():
        return dest
    model, tokenizer = load_run(init)[1:] if isinstance(init, Path) else init
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".init-"))
    try:
        save_weights(model, tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process of this machine was first
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


EXPORT_MARKER = "thinpipe-export.json"  # in every export: what it wrote, so that --overwrite removes only that


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() or p.is_symlink()}


def _earlier_export(out: Path, overwrite: bool) -> set[str] | None:
    """The files of the earlier export in ``out`` that --overwrite may remove (None: ``out`` is empty or new);
    refused in one line when ``out`` holds anything else."""
    if not out.is_dir() or not any(out.iterdir()):
        return None
    try:
        written = set(json.loads((out / EXPORT_MARKER).read_text())["files"]) | {EXPORT_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"--out {out} is not empty and is no export of thinpipe's (no {EXPORT_MARKER}): export "
                          "into a new or empty folder") from None
    if not overwrite:
        raise ConfigError(f"--out {out} holds an earlier export: add --overwrite to replace it, or choose another "
                          "--out")
    foreign = sorted(_files(out) - written)
    if foreign:
        raise ConfigError(f"--out {out} holds files the earlier export did not write ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): move them away, or choose another --out")
    return written


def _remove_export(folder: Path, written: set[str]) -> None:
    """An earlier export, moved aside: its own files, then the folders they leave empty (and nothing else)."""
    for name in _files(folder) & written:  # what is there: a name in the marker never reaches outside the folder
        (folder / name).unlink()
    for d in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        try:
            d.rmdir()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        say(f"[thinpipe] warning: {folder} keeps files the earlier export did not write; left in place")


def export(run_dir: str | Path | list, out: str | Path, overwrite: bool = False, lora_save: str | None = None) -> Path:
    """Write the job's model (``load_run``: any engine; a dist job's machines' folders, a list) as a Hugging Face
    folder that ``from_pretrained`` loads, with
    ``thinpipe-export.json`` naming the files written. ``out`` is new, empty, or (with ``overwrite``) an
    earlier export holding only its own files; never the run, a folder inside it or one containing it. A LoRA
    run's adapters: merged or in peft's format as ``lora_save`` says (default: the run's ``train.lora.save``)."""
    runs = [Path(r).resolve() for r in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    out = Path(out)
    check_out_path(out)
    out = out.resolve()
    for r in runs:
        refuse_nested(r, out, f"--run {r} and --out {out}")
    written = _earlier_export(out, overwrite)
    cfg = run_config(runs)
    if lora_save is not None:  # checked before any weights are read
        cfg.train.lora.save = lora_save
        cfg.train.lora.validate()
    if adapter_only(cfg) and is_random_preset(resolve_model_name(cfg.model.name)):
        raise ConfigError(f"--lora-save adapter names the base model's folder, but {cfg.model.name} is a random "
                          "preset with none on disk: export the merged model (--lora-save merged)")
    model, tokenizer = load_run(runs if len(runs) > 1 else runs[0], merge=False)[1:]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
    old = None
    try:
        write_into(tmp, model, tokenizer, cfg)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"run": str(runs[0]) if len(runs) == 1 else list(map(str, runs)),
                                                     "files": sorted(_files(tmp))}, indent=1))
        if written is not None:  # the earlier export moves aside, the new one takes its place
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-old-"))
            out.rename(old / "export")
        elif out.is_dir():
            out.rmdir()  # empty (checked above): the rename below takes its place
        tmp.rename(out)
    except BaseException:
        if old is not None and (old / "export").is_dir() and not out.exists():
            (old / "export").rename(out)  # the earlier export back where it was
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: absent once renamed
    if old is not None:
        assert written is not None  # old: where the earlier export (its files: written) was moved aside
        _remove_export(old / "export", written)
        try:
            old.rmdir()
        except OSError:
            pass
    return out
