"""The simulated mesh a command samples or scores through: a run folder's (its trained stages and
boundaries, restored from its checkpoint) or a model's, split as ``--set`` says (``mesh.pp=2``: two
stages). ``thinpipe generate`` and ``thinpipe eval`` share it, so both see the same stages."""

from __future__ import annotations

from pathlib import Path

from thinpipe.config import ConfigError


def build_mesh(run: str | None, model: str | None, sets: list[str], device: str | None = None):
    """(mesh, its ``LoadedModel``: the model it was built from and the tokenizer) of run folder ``run`` or
    of ``model`` (a preset, folder or .gguf; None: the default) with the config overrides ``sets``;
    ``device``: a ``train.device`` value that ``sets`` may override."""
    from thinpipe.config import load_config

    device_set = [f"train.device={device}"] if device else []
    if run:
        from thinpipe.commands.preflight import check_run
        from thinpipe.engine.run_folder import load_mesh

        if model:
            raise ConfigError("give --model or --run, not both: a run folder holds its own model")
        others = [s for s in sets if s.split("=", 1)[0].strip() != "train.device"]
        if others:
            raise ConfigError(f"a run folder is used with the run's own config: --set takes only train.device there, "
                              f"got {others[0]!r}")
        cfg = load_config(None, [*device_set, *sets])
        check_run(Path(run))
        _, mesh, loaded = load_mesh(run, cfg.train.device)
        return mesh, loaded
    from thinpipe.commands.preflight import validate_names
    from thinpipe.engine.sim_mesh import SimMesh
    from thinpipe.rank.from_config import load, place

    cfg = load_config(None, [*device_set, *sets, *([f"model.name={model}"] if model else [])])
    validate_names(cfg)
    dev = place(cfg)
    loaded = load(cfg)
    return SimMesh(loaded.model, cfg, dev), loaded


def is_run_folder(spec: str | None) -> bool:
    """Whether a ``--model`` value names a thinpipe run folder (it holds the run's config.toml)."""
    return bool(spec) and Path(spec).is_dir() and (Path(spec) / "config.toml").is_file()
