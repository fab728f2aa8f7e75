"""Run folders: load one back (mesh, merged model), export one.

A run folder holds ``config.toml`` and ``checkpoint/`` (``engine/loop.py`` writes them). Loading rebuilds
the mesh of the run's own config and restores the simulation's newest checkpoint that verifies into
it (``thinpipe/checkpoint.py``: safetensors + JSON, nothing in a run folder can run code).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from thinpipe.checkpoint import latest_complete, refuse_legacy, restoring
from thinpipe.config import ConfigError, load_config
from thinpipe.console import say
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import merge_stages
from thinpipe.models.lora import merge_lora
from thinpipe.placement import resolve_device
from thinpipe.rank.from_config import load
from thinpipe.runlock import check_out_path


def load_mesh(run_dir: str | Path, device: str = "cpu"):
    """(config, mesh restored from the checkpoint on ``device`` (a ``train.device`` value), LoadedModel)
    of a finished or checkpointed run; the checkpoint loads on any device, whatever it trained on."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a thinpipe run folder (no config.toml): give the --out folder of a "
                          "`thinpipe train` run")
    found = latest_complete(run_dir / "checkpoint", "mesh", warn=say)
    if found is None:
        refuse_legacy(run_dir / "checkpoint")
        raise ConfigError(f"{run_dir} holds no checkpoint of the simulation (checkpoint/step*/mesh.*); a dist run's "
                          "per-rank checkpoints are resumed with --engine dist")
    cfg = load_config(run_dir / "config.toml")
    dev = resolve_device(device)
    loaded = load(cfg)
    mesh = SimMesh(loaded.model, cfg, dev)
    with restoring(run_dir / "checkpoint"):  # a hand-edited part whose digests verify: one line
        mesh.load_state_dict(found[1]["mesh"])
    return cfg, mesh, loaded


def load_run(run_dir: str | Path, device: str = "cpu"):
    """(config, merged Hugging Face model on ``device``, tokenizer) of a finished or checkpointed run."""
    cfg, mesh, loaded = load_mesh(run_dir, device)
    if any(b.architectural for b in mesh.boundaries):  # the boundary kind says it is part of the model
        raise ConfigError(f"{run_dir} trained with boundary.kind = {cfg.boundary.kind}, "
                          "whose projectors are part of the model: a plain Hugging Face model would drop them. "
                          "`thinpipe eval --model RUN` evaluates it through its boundaries; "
                          "`thinpipe analyze --run RUN` inspects them")
    return cfg, merge_lora(merge_stages(loaded.model, mesh.replicas[0])).to(mesh.device), loaded.tokenizer


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
        model.save_pretrained(tmp)
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


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write replica 0's weights as a Hugging Face folder that ``from_pretrained`` loads, with
    ``thinpipe-export.json`` naming the files written. ``out`` is new, empty, or (with ``overwrite``) an
    earlier export holding only its own files; never the run, a folder inside it or one containing it."""
    run_dir, out = Path(run_dir).resolve(), Path(out)
    check_out_path(out)
    out = out.resolve()
    refuse_nested(run_dir, out, f"--run {run_dir} and --out {out}")
    written = _earlier_export(out, overwrite)
    _, model, tokenizer = load_run(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
    old = None
    try:
        model.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"run": str(run_dir), "files": sorted(_files(tmp))}, indent=1))
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
