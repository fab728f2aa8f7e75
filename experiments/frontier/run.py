"""Issue 17's frontier: held-out loss against PP bytes on the anchor-priors recipe.

Recipe: experiments/anchor_priors (SmolLM2-135M, 4 stages, MATH, 4 x 128 tokens per step, 100 steps,
lr 1e-4, held-out loss every 20 steps on 32 MATH-500 rows), so that its committed arms (Dense, M90,
M95, top-K 95%, the anchor arms) sit on the same table; ``Dense`` is run again here with today's code
as the control that the old arms are comparable (report.py prints the difference).

    .venv/bin/python experiments/frontier/run.py [--only ARM,...] [--jobs 2 --threads 1]
    .venv/bin/python experiments/frontier/report.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anchor_priors.run import BASE  # noqa: E402  (the same recipe, by construction)
from arms import arm_dir, run_suite, select  # noqa: E402


def outlier(fwd: int, bwd: int, channels: int = 16, per_token: bool = False) -> dict:
    arm = {"boundary.kind": "outlier", "boundary.fwd_bits": fwd, "boundary.bwd_bits": bwd,
           "boundary.outlier_channels": channels}
    if per_token:  # one forward scale pair per token (36 -> 4 B) and bf16 intact channels (64 -> 32 B)
        arm.update({"boundary.outlier_scale_group": 576, "boundary.outlier_dtype": "bfloat16"})
    return arm


ARMS = {
    "Dense": {},
    "Outlier 2b-2b": outlier(2, 2),
    "Outlier 2b-1b": outlier(2, 1),
    "Outlier 1b-1b": outlier(1, 1),
    # 2b-1b vs 2b-2b: the backward's bits barely matter, the forward's do; the same bytes as 2b-2b
    # spent on the forward instead:
    "Outlier 3b-1b": outlier(3, 1),
    "Outlier 4b-1b": outlier(4, 1),
    "4-bit Quant": {"boundary.kind": "quant4"},
    "2-bit Quant": {"boundary.kind": "quant2"},
    "TAH-Quant 2-8": {"boundary.kind": "tahquant"},
    "TopK90": {"boundary.kind": "topk", "boundary.p": 0.9},          # top-K's second ratio (TopK95 is committed)
    "MAPL r58 pca": {"boundary.kind": "mapl", "boundary.rank": 58, "boundary.init": "pca", "diag.every": 0},  # ~10x; r28 is committed
    # 3b-1b ended +1.08% at 10.9x: the forward's bytes on bits instead of scales and fp32 channels
    "Outlier 4b-1b tok": outlier(4, 1, per_token=True),
    "Outlier 3b-1b tok": outlier(3, 1, per_token=True),
    "Outlier 2b-2b seed 1": {**outlier(2, 2), "train.seed": 1},
    "Dense seed 1": {"train.seed": 1},
    "Outlier 4b-1b tok seed 1": {**outlier(4, 1, per_token=True), "train.seed": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/frontier/results")
    ap.add_argument("--jobs", type=int, default=2, help="arms run in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    ap.add_argument("--only", default="", help="comma-separated arm names to run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps({"base": BASE, "arms": ARMS}, indent=2))
    arms = select(ARMS, args.only, "frontier")
    run_suite(arms, out, BASE, args.jobs, args.threads)
    for name in arms:
        shutil.rmtree(arm_dir(out, name) / "checkpoint", ignore_errors=True)


if __name__ == "__main__":
    main()
