"""``thinpipe prune``: global magnitude pruning of a run at each sparsity, re-evaluated (anchor-priors §5.5);
what it computes is ``prune_lib.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

from thinpipe.commands.common import add_device_arg
from thinpipe.commands.preflight import check_run, validate_tasks
from thinpipe.config import ConfigError
from thinpipe.runlock import check_out_path

NAME = "prune"
HELP = "post-hoc global magnitude pruning at several sparsities, re-evaluated (§5.5)"


def add_arguments(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("--run", required=True, action="append",
                    help="a run folder of any engine; a dist job across machines: each machine's --out "
                         "(--run A --run B), written into the first")
    pr.add_argument("--sparsity", default="0,0.1,0.2,0.3,0.4,0.5", help="comma-separated fractions of the decoder "
                                                                       "matrices' weights to zero")
    pr.add_argument("--tasks", default="", help="also multiple-choice accuracy on these tasks, e.g. arc_easy,piqa")
    pr.add_argument("--limit", type=int, help="items per task")
    pr.add_argument("--out", help="where prune.json / prune.png go (default: RUN/prune)")
    add_device_arg(pr)


def run(args) -> int:
    """Global magnitude pruning of a run at each sparsity, re-evaluated (thinpipe/commands/prune_lib.py)."""
    from thinpipe.commands.prune_lib import parse_sparsities, prune_sweep

    runs = [Path(r) for r in args.run]
    check_run(runs)
    if args.out:
        check_out_path(Path(args.out))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    validate_tasks(tasks)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    result = prune_sweep(runs if len(runs) > 1 else runs[0], parse_sparsities(args.sparsity), tasks, args.limit,
                         Path(args.out) if args.out else None, args.device)
    head = f"{'sparsity':>9}{'zeros':>12}{'held-out':>10}{'ppl':>9}" + "".join(f"{t + ' acc_norm':>22}" for t in tasks)
    print(head)
    for r in result["rows"]:
        print(f"{r['sparsity']:>9.2f}{r['zeros']:>12}{r['val_loss']:>10.4f}{r['val_ppl']:>9.2f}"
              + "".join(f"{r[t + '_acc_norm']:>22.4f}" for t in tasks))
    print(f"saved {Path(args.out) if args.out else runs[0] / 'prune'}/ (prune.json, prune.png)")
    return 0
