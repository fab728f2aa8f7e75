"""The SFT arms of the RL-after-SFT experiment (anchor-priors App. D / Table 9): the demo's boundaries
(``thinpipe/commands/demo.py`` ARMS: Dense, M95, Outlier LM 4b-1b -- here "Outlier 4b-1b") on the
demo's FULL recipe, fine-tuned on ``data/sft.jsonl`` (``make_data.py``) so that the model learns the
worked-solution format ending "The answer is N." before GSPO starts from each arm.

Each arm is one ``thinpipe train`` process (``experiments/arms.py`` ``run_arm``), run one after the
other. The run folders (with their checkpoints, ~2 GB each) go under ``--runs`` (default
/work/rl_runs, outside the repository); their small files (summary.json, metrics.jsonl, config.toml)
are copied to ``results/runs/sft_<arm>/``. Then:

    .venv/bin/python experiments/rl/make_data.py
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/sft.py --steps 60
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/eval_heldout.py   # results/sft_baseline.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import run_arm, select  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# The demo's FULL recipe (thinpipe/commands/demo.py), on this experiment's data. Only the final
# checkpoint is written (checkpoint_every 0): it is what GSPO and the held-out evaluation load.
BASE = {"model.name": "smollm2-135m", "data.name": "experiments/rl/data/sft.jsonl", "mesh.pp": 4,
        "train.batch_size": 4, "train.seq_len": 128, "train.microbatches": 2, "train.lr": 1e-4,
        "data.val_rows": 16, "eval.every": 20, "model.tied": "untie", "train.checkpoint_every": 0}
ARMS = {"Dense": {"boundary.kind": "identity"},
        "M95": {"boundary.kind": "mask", "boundary.p": 0.95},
        "Outlier 4b-1b": {"boundary.kind": "outlier", "boundary.fwd_bits": 4, "boundary.bwd_bits": 1,
                          "boundary.outlier_grid": "lloyd-max", "boundary.outlier_scale_group": -1,
                          "boundary.outlier_bwd_scale_group": -1, "boundary.outlier_dtype": "bfloat16"}}
SMALL_FILES = ("summary.json", "metrics.jsonl", "config.toml")


def folder_name(arm: str) -> str:
    return "sft_" + arm.replace(" ", "_")


def copy_small(run: Path, dest: Path) -> None:
    """The files of a finished run worth committing (no checkpoint)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        if (run / f).is_file():
            shutil.copy2(run / f, dest / f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", default="/work/rl_runs", help="where the run folders (with checkpoints) go")
    ap.add_argument("--results", default=str(HERE / "results" / "runs"))
    ap.add_argument("--only", default="", help="comma-separated arm names")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--suffix", default="", help="appended to the run folders' names (e.g. _12steps)")
    ap.add_argument("--data", default=BASE["data.name"],
                    help="the SFT rows (e.g. experiments/rl/data/sft_noisy.jsonl, a flawed demonstrator's)")
    args = ap.parse_args()
    if not (ROOT / args.data).is_file():
        raise SystemExit(f"{args.data} is missing: run experiments/rl/make_data.py first")
    base = {**BASE, "train.steps": args.steps, "data.name": args.data}
    runs, results = Path(args.runs), Path(args.results)
    for name, sets in select(ARMS, args.only, "rl-sft").items():
        folder = runs / (folder_name(name) + args.suffix)
        summary = run_arm(name, sets, runs, base, args.threads, folder=folder)
        if summary:
            copy_small(folder, results / folder.name)
            print(f"  {name}: final val loss {summary['final_val_loss']:.4f}, {summary['wall_s']:.0f} s "
                  f"({summary['wall_s'] / args.steps:.2f} s/step)", flush=True)
    if not args.suffix:  # the recipe of the arms' main runs
        (results / "sft_recipe.json").write_text(json.dumps({"base": base, "arms": ARMS, **code_stamp()}, indent=2))
    return 0


if __name__ == "__main__":
    import os

    os.chdir(ROOT)  # data.name is relative to the repository root
    raise SystemExit(main())
