"""``thinpipe train``: one run, on the simulated mesh (``--engine sim``), as one rank of a torchrun or
``thinpipe launch`` job (``dist``), or as one stage of an elastic replica (``elastic``, docs/elastic.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from thinpipe.commands.preflight import check_out, claim_out, validate_names
from thinpipe.config import ConfigError, load_config
from thinpipe.runlock import RunLock, take_run_lock

NAME = "train"
HELP = "train on the simulated mesh"


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--recipe", metavar="NAME", help="a shipped system to start from (`thinpipe recipes` lists them); "
                        "--config and --set override it")
    t.add_argument("--config", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. mesh.pp=4")
    t.add_argument("--out", required=True, help="run folder (config, metrics, summary, plot, checkpoint)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace the run in --out (without it, a folder that "
                                                            "holds a run is refused)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--init-from", metavar="RUN_OR_HF_FOLDER",
                   help="start from these weights (a run folder or a Hugging Face folder), with a fresh optimizer and "
                        "schedule: a second phase, e.g. SFT after pretraining")
    t.add_argument("--engine", choices=["sim", "dist", "elastic"], default="sim",
                   help="sim: the whole mesh in this process (default); dist: this process is one rank (torchrun); "
                        "elastic: one stage of replica $REPLICA_GROUP_ID on torchft (thinpipe launch --elastic)")


def run(args) -> int:
    cfg = load_config(args.config, args.set, recipe=args.recipe)
    out = Path(args.out)
    if args.engine != "elastic":  # an elastic job's folder is its launcher's to claim (replicas write sub-folders)
        check_out(out, args.resume, args.overwrite)
    if args.init_from and args.engine == "elastic":
        raise ConfigError("--init-from is not taken by --engine elastic (its replicas would each export the weights): "
                          "export once with `thinpipe export` and give the folder as --set model.name=FOLDER")
    init = None
    if args.init_from:
        from thinpipe.engine.run_folder import read_init

        if args.resume:
            raise ConfigError("--init-from starts a new run from other weights, --resume continues this one: give one")
        # read before --overwrite removes anything (the process that removes holds the weights first)
        init = read_init(args.init_from, out, load=os.environ.get("LOCAL_RANK", "0") == "0")
    else:
        validate_names(cfg)  # before the folder is made
    # one job per folder (runlock.py): a rank of `thinpipe launch` is not refused, rank 0 of torchrun takes it
    lock = RunLock() if args.engine == "elastic" else take_run_lock(
        out, lead=args.engine != "dist" or os.environ.get("RANK", "0") == "0", create=not args.resume)
    with lock:
        if args.engine != "elastic":
            claim_out(out, args.resume, args.overwrite)
        if init is not None:
            from thinpipe.engine.run_folder import init_weights

            cfg.model.init_from = str(Path(args.init_from).resolve())
            cfg.model.name = str(init_weights(init, out / "init"))
            validate_names(cfg)
        return _train(args, cfg)


def _train(args, cfg) -> int:
    if args.engine == "elastic":
        # torchft is needed only here (an optional dependency: pip install torchft); its Rust logger
        # reads RUST_LOG when imported: per-quorum INFO lines off (thinpipe writes events.jsonl)
        os.environ.setdefault("RUST_LOG", "warn")
        from thinpipe.engine.elastic_rank import train_elastic
        from thinpipe.engine.elastic_setup import check_elastic, replica_folder

        check_elastic(cfg)
        if args.resume:
            raise ConfigError("an elastic job resumes through its launcher: thinpipe launch --elastic --resume -- "
                              "train --out ... (each replica continues from its newest checkpoint)")
        summary = train_elastic(cfg, args.out, progress=not args.quiet)
        if summary is not None:
            print_summary(summary, replica_folder(Path(args.out), summary["replica"], summary["restart"]))
        return 0
    if args.engine == "dist":
        from thinpipe.engine.dist_engine import check_supported, train_dist
        from thinpipe.engine.loop import resolve_resume

        check_supported(cfg)
        cfg = resolve_resume(cfg, Path(args.out), args.resume)
        summary = train_dist(cfg, args.out, progress=not args.quiet, resume=args.resume)
        if summary is not None:
            print_summary(summary, Path(args.out))
        return 0
    from thinpipe.engine.sim_engine import train

    summary = train(cfg, args.out, resume=args.resume, progress=not args.quiet)
    print_summary(summary, Path(args.out))
    return 0


def print_summary(summary: dict, out: Path) -> None:
    rows = [("steps", summary["steps"]), ("tokens", summary["tokens"])]
    key = summary["val_key"]  # the objective's held-out measure (objective/spec.py: ObjectiveSpec.val_key)
    name = key.removeprefix("val_").replace("_", " ")
    rows += [(f"held-out {name}: start", f"{summary[f'initial_{key}']:.4f}"),
             (f"held-out {name}: end", f"{summary[f'final_{key}']:.4f}")]
    if "val_ppl" in summary:
        rows.append(("held-out perplexity", f"{summary['val_ppl']:.2f}"))
    rows += [("wall", f"{summary['wall_s']:.1f} s ({summary['tokens_per_s']:.0f} tok/s)")]
    rows += [(f"bytes/token {axis}", f"{v:.1f}") for axis, v in summary["bytes_per_token"].items() if v]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"results in {out}/ (summary.json, metrics.jsonl, loss.png)")
    if summary.get("model"):
        elsewhere = summary.get("engine") == "dist" and summary.get("model_rank")  # another rank's machine
        where = (f"in {summary['model']}/ of global rank {summary['model_rank']}'s --out (train.model_rank)"
                 if elsewhere else f"in {out / summary['model']}/")
        how = ("PeftModel.from_pretrained(base, ...) loads the adapter" if summary.get("model_format") == "peft"
               else "AutoModelForCausalLM.from_pretrained loads it")
        print(f"the model {where} ({how})")
