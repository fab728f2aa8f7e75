"""``thinpipe plan``: from the command line's arguments to the printed prediction or advice (docs/plan.md)."""

from __future__ import annotations

import json

from thinpipe.config import ConfigError, load_config
from thinpipe.plan.advice import advise
from thinpipe.plan.device import resolve_device
from thinpipe.plan.planner import ARCHITECTURES, PRESET_DEVICE, PRESETS, plan
from thinpipe.plan.report import print_advice, print_plan


def run_plan(args) -> int:
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
    cfg = load_config(args.config, sets + args.set)
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
    result = plan(cfg, device, replica_mtbf_h=args.replica_mtbf_h, restart_s=args.restart_s)
    result["device"] = name
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_plan(result, name)
    return 0
