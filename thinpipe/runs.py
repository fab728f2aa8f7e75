"""Run folders: load one back (mesh, merged model), export one.

A run folder holds ``config.toml`` and ``checkpoint/`` (``run.py`` writes them). Loading rebuilds
the mesh of the run's own config and restores the simulation's newest checkpoint that verifies into
it (``thinpipe/checkpoint.py``: safetensors + JSON, nothing in a run folder can run code).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


from thinpipe.checkpoint import latest_complete, refuse_legacy
from thinpipe.config import ARCHITECTURAL_KINDS, ConfigError, load_config
from thinpipe.engine.setup import load
from thinpipe.engine.sim import SimMesh
from thinpipe.models import merge_stages
from thinpipe.log import say
from thinpipe.models.lora import merge_lora
from thinpipe.placement import resolve_device


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
    mesh.load_state_dict(found[1]["mesh"])
    return cfg, mesh, loaded


def load_run(run_dir: str | Path, device: str = "cpu"):
    """(config, merged Hugging Face model on ``device``, tokenizer) of a finished or checkpointed run."""
    cfg, mesh, loaded = load_mesh(run_dir, device)
    if cfg.boundary.kind in ARCHITECTURAL_KINDS:
        raise ConfigError(f"{run_dir} trained with boundary.kind = {cfg.boundary.kind}, whose projectors are part of "
                          "the model: a plain Hugging Face model would drop them. `thinpipe eval --model RUN` evaluates "
                          "it through its boundaries; `thinpipe analyze --run RUN` inspects them")
    return cfg, merge_lora(merge_stages(loaded.model, mesh.replicas[0])).to(mesh.device), loaded.tokenizer


def init_weights(src: str | Path, dest: str | Path) -> Path:
    """The Hugging Face folder a ``train --init-from SRC`` run loads its weights from: ``SRC`` itself
    when it is one (``config.json``), else a run folder's merged weights (LoRA merged, replica 0)
    exported once into ``dest``. Written to a temporary folder and renamed, so processes of one
    machine (dist ranks) that race here all end with the same complete folder."""
    src, dest = Path(src).resolve(), Path(dest).resolve()
    if (src / "config.json").is_file():
        return src
    if not (src / "config.toml").is_file():
        raise ConfigError(f"--init-from {src}: neither a Hugging Face model folder (config.json) nor a thinpipe run "
                          "folder (config.toml + checkpoint/)")
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".init-"))
    try:
        _, model, tokenizer = load_run(src)
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


def export(run_dir: str | Path, out: str | Path) -> Path:
    """Write replica 0's weights as a Hugging Face folder that ``from_pretrained`` loads."""
    _, model, tokenizer = load_run(run_dir)
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".export-"))
    try:
        model.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp), out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
