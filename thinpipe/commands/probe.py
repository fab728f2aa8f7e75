"""``thinpipe probe``: each boundary kind's forward damage, gradient alignment and bytes on a model before any
training (docs/probe.md); what it measures is ``probe_lib.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinpipe.commands.common import add_device_arg
from thinpipe.commands.preflight import check_run, validate_names
from thinpipe.config import ConfigError, apply_overrides, load_config, parse_sets
from thinpipe.runlock import check_out_path

NAME = "probe"
HELP = "each boundary kind's forward damage, gradient alignment and bytes, no training"


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", help="the model (model.name), e.g. smollm2-135m")
    q.add_argument("--run", action="append",
                   help="a run folder of any engine instead of --model/--config: its trained model (LoRA merged) and "
                        "its settings (mesh.pp, data, seq_len, batch); a dist job across machines: --run A --run B")
    q.add_argument("--config", help="TOML config file (mesh.pp, data, train.seq_len, train.batch_size apply)")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. mesh.pp=4")
    q.add_argument("--kinds", help="comma-separated boundary kinds to probe (default: every kind of the grid)")
    q.add_argument("--boundaries", help="comma-separated boundary indices to compress (default: all)")
    q.add_argument("--batches", type=int, default=4, help="held-out batches per arm")
    q.add_argument("--out", help="write probe.json and probe.png (loss against bytes) here")
    q.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    add_device_arg(q)


def run(args) -> int:
    loaded = None
    if args.run:
        if args.model or args.config:
            raise ConfigError("--run takes the model and its settings from the run: leave out --model and --config "
                              "(--set still overrides a setting)")
        cfg, loaded = _run_model([Path(r) for r in args.run], args.set)
    else:
        cfg = load_config(args.config, ([f"model.name={args.model}"] if args.model else []) + args.set)
        validate_names(cfg)
    if args.out:
        check_out_path(Path(args.out))
    from thinpipe.commands.probe_lib import format_table, probe, select_grid, write  # the model libraries

    cfg.train.device = args.device
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    result = probe(cfg, select_grid(kinds), args.batches, _int_list(args.boundaries, "--boundaries"),
                   progress=not args.json, loaded=loaded)
    if args.out:
        write(result, Path(args.out))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        if args.out:
            print(f"wrote {Path(args.out) / 'probe.json'} and {Path(args.out) / 'probe.png'}")
    return 0


def _run_model(runs: list[Path], sets: list[str]):
    """(the run's config with ``sets`` applied and LoRA off, its model as ``load`` returns one): a run of any engine
    (``engine/run_folder.py: load_run``), probed as a model of its own."""
    from thinpipe.engine.run_folder import load_run
    from thinpipe.models.loading import LoadedModel

    check_run(runs)
    cfg, model, tokenizer = load_run(runs if len(runs) > 1 else runs[0])
    # the adapters are merged into the model probed
    apply_overrides(cfg, {**parse_sets(sets), "train.lora.rank": 0, "train.lora.save": "merged"}, source="--set")
    cfg.validate()
    return cfg, LoadedModel(model, tokenizer, str(runs[0]))


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, e.g. 0,2; got {text!r}") from None
