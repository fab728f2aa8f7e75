"""``thinpipe plan``: from the command line's arguments to the printed prediction or advice (docs/plan.md)."""

from __future__ import annotations

import argparse
import json

from thinpipe.config import ConfigError, load_config
from thinpipe.plan.advice import advise
from thinpipe.plan.device import resolve_device
from thinpipe.plan.memory import fit
from thinpipe.plan.planner import ARCHITECTURES, PRESET_DEVICE, PRESETS, plan
from thinpipe.plan.report import print_advice, print_plan

NAME = "plan"
HELP = "predict step time, tokens/s, bytes and anchor staleness (paper App. H, J)"


def add_arguments(pl: argparse.ArgumentParser) -> None:
    pl.add_argument("--preset", help="a deployment preset, e.g. paper-llama1b")
    pl.add_argument("--recipe", metavar="NAME", help="a shipped system to start from (`thinpipe recipes` lists them); "
                        "--config and --set override it")
    pl.add_argument("--config", help="TOML config file")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. boundary.p=0.95")
    pl.add_argument("--device", help="a100-40gb | h100 | rtx-4090 (data sheet) | cpu | cuda | cuda:N (measured here, "
                                     "cached) (default: the preset's, else a100-40gb)")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.add_argument("--replica-mtbf-h", type=float, help="elastic replicas (docs/elastic.md): each fails this often "
                    "(hours, mean); adds the expected tokens/s with that churn")
    pl.add_argument("--restart-s", type=float, default=60.0, help="with --replica-mtbf-h: seconds to start a lost "
                                                                  "replica again, model load included (60)")
    pl.add_argument("--remeasure", action="store_true", help="with --device cpu or cuda: measure again instead of the "
                                                             "cached profile (do it on an idle machine)")
    pl.add_argument("--target-tps", type=float, help="advice: the least compression (mask p, PowerSGD rank, DiLoCo H) "
                                                     "reaching this many tokens/s (exit 1 if none can)")
    pl.add_argument("--max-mbps", type=float,
                    help="advice: every link at this many Mbit/s; without --target-tps, the least compression at which "
                         "the links keep up with compute (overlapped)")
    pl.add_argument("--memory-gb", type=float, metavar="N",
                    help="each rank's device (or, with --device cpu, machine) holds N GiB: say whether every rank's "
                         "predicted peak fits and, if not, the cheapest change that makes it fit (exit 1 if none)")
    pl.add_argument("--probe",
                    help="advice within a quality bound: a probe.json of `thinpipe probe` (same model, stages)")
    pl.add_argument("--max-damage", type=float, default=0.01, help="with --probe: the largest forward damage accepted, "
                                                                    "a fraction of the dense held-out loss (0.01)")


def run(args) -> int:
    """``thinpipe plan``: the prediction, or with ``--target-tps`` / ``--max-mbps`` the advice; exit 1 when no
    setting meets the advice's goal."""
    if args.probe and args.target_tps is None and args.max_mbps is None:  # it bounds the advice, nothing else reads it
        raise ConfigError(f"--probe {args.probe} bounds the advice's quality: give --target-tps or --max-mbps with it "
                          "(or drop --probe)")
    if not args.max_damage >= 0:  # before reading the probe
        raise ConfigError(f"--max-damage must be >= 0 (a fraction of the dense held-out loss), got {args.max_damage}")
    sets = []
    if args.preset:
        if args.preset not in PRESETS:
            raise ConfigError(f"unknown preset {args.preset!r}: choose one of {', '.join(sorted(PRESETS))}")
        sets = [f"{k}={v}" for k, v in PRESETS[args.preset].items()]
    cfg = load_config(args.config, sets + args.set, recipe=args.recipe)
    name = args.device or PRESET_DEVICE.get(args.preset, "a100-40gb")
    if cfg.train.dtype == "auto":  # as a run resolves it: bf16 on a GPU, fp32 on the CPU
        cfg.train.dtype = "float32" if name == "cpu" else "bfloat16"
    if cfg.model.name not in ARCHITECTURES:
        raise ConfigError(f"thinpipe plan knows no architecture {cfg.model.name!r}: choose one of "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    device = resolve_device(name, ARCHITECTURES[cfg.model.name], cfg.train.dtype, args.remeasure)
    if args.target_tps is not None or args.max_mbps is not None:
        return print_advice(advise(cfg, device, args.target_tps, args.max_mbps, args.probe, args.max_damage), name,
                             args.json)
    if args.replica_mtbf_h is not None and args.replica_mtbf_h <= 0:
        raise ConfigError(f"--replica-mtbf-h must be > 0 hours, got {args.replica_mtbf_h}")
    if args.restart_s < 0:
        raise ConfigError(f"--restart-s must be >= 0 seconds, got {args.restart_s}")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise ConfigError(f"--memory-gb must be > 0 GiB (each rank's memory), got {args.memory_gb}")
    result = plan(cfg, device, replica_mtbf_h=args.replica_mtbf_h, restart_s=args.restart_s, memory_device=name)
    result["device"] = name
    if args.memory_gb is not None:
        result["memory"]["fit"] = fit(cfg, ARCHITECTURES[cfg.model.name], name, args.memory_gb)
    code = 0 if args.memory_gb is None or result["memory"]["fit"]["fits"] or result["memory"]["fit"]["change"] else 1
    if args.json:
        print(json.dumps(result, indent=2))
        return code
    print_plan(result, name)
    return code
