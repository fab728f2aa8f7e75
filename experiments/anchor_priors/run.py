"""Anchor priors at small scale: SmolLM2-135M adapted on a real domain, every arm token-matched.

Each arm is one `thinpipe train` run (same data order, steps, tokens, seed); arms run as parallel
processes. Results: <out>/<arm>/summary.json + metrics.jsonl, then `report.py` builds the tables
and plots. Rerun everything with

    .venv/bin/python experiments/anchor_priors/run.py --suite main --out experiments/anchor_priors/results

Suites: main (Table 1 arms), p_delta (Table 2 p x delta), tau, alpha, rescale, variants, control,
medical, smoke.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import arm_dir as shared_arm_dir  # noqa: E402
from arms import run_suite, select  # noqa: E402

# The shared recipe for every arm (see README.md here for why these sizes).
BASE = {"model.name": "smollm2-135m", "data.name": "math", "mesh.pp": 4, "train.batch_size": 4,
        "train.seq_len": 128, "train.microbatches": 2, "train.steps": 100, "train.lr": 1e-4,
        "data.val_rows": 32, "eval.every": 20, "model.tied": "untie", "diag.every": 20,
        "train.checkpoint_every": 0}
AP = {"mesh.anchor": 1}


def mask(p):
    return {"boundary.kind": "mask", "boundary.p": p}


def topk(p):
    return {"boundary.kind": "topk", "boundary.p": p}


SUITES = {
    "main": {"Dense": {}, "M90": mask(0.90), "M95": mask(0.95), "M90+AP": {**mask(0.90), **AP},
             "M95+AP": {**mask(0.95), **AP}, "TopK95": topk(0.95), "TopK95+AP": {**topk(0.95), **AP}},
    "p_delta": {f"M{int(p * 100)}+AP d{d}": {**mask(p), **AP, "anchor.staleness": d}
                for p in (0.90, 0.95, 0.99) for d in (10, 20, 50)},
    "tau": {f"M95+AP tau{t:g}": {**mask(0.95), **AP, "optim.spectral.tau": t} for t in (1e-5, 1e-4, 1e-3, 1e-1)},
    "alpha": {f"M95+AP alpha{a:g}": {**mask(0.95), **AP, "optim.spectral.alpha": a} for a in (0.0, 0.3, 0.5, 1.0)},
    "rescale": {"M95 norescale": {**mask(0.95), "boundary.rescale": False},
                "M95+AP norescale": {**mask(0.95), **AP, "boundary.rescale": False},
                "M95+AP reltau": {**mask(0.95), **AP, "optim.spectral.relative_tau": True}},
    "variants": {"M95+AP biascorr": {**mask(0.95), **AP, "optim.spectral.bias_correction": True},
                 "M95+AP every5": {**mask(0.95), **AP, "anchor.every": 5},
                 "M95+AP mix": {**mask(0.95), **AP, "anchor.mix": 0.5},
                 "M95+AP pwarmup": {**mask(0.95), **AP, "boundary.p_warmup": 30},
                 "M95 half-boundaries": {**mask(0.95), "boundary.masked": [0, 2]}},
    # Controls for "what helps is a smaller masked update" (README, Table 2 claims): M95 without AP
    # at a smaller learning rate, the scale tau = 1e-1 / alpha = 0.3 leaves the update at.
    "control": {"M95 lr3e-5": {**mask(0.95), "train.lr": 3e-5}, "M95 lr1e-5": {**mask(0.95), "train.lr": 1e-5}},
    # Second domain: MedMCQA -> MedQA-USMLE. MedQA vignettes run to ~400 tokens, so rows are 512
    # long (1 x 512 = the same 512 tokens per step as the math recipe's 4 x 128).
    "medical": {"med Dense": {}, "med M95": mask(0.95), "med M95+AP": {**mask(0.95), **AP},
                "med M95 norescale": {**mask(0.95), "boundary.rescale": False}},
    "smoke": {"Dense": {"train.steps": 4, "eval.every": 2, "diag.every": 2},
              "M95+AP": {**mask(0.95), **AP, "anchor.staleness": 2, "train.steps": 4, "eval.every": 2,
                         "diag.every": 2}},
}


# Recipe changes that hold for a whole suite.
SUITE_BASE = {"medical": {"data.name": "medical", "train.batch_size": 1, "train.seq_len": 512,
                          "train.microbatches": 1, "data.val_rows": 16}}

# Ablation points that are, by construction, an arm of another suite: they are not rerun.
ALIASES = {"M90+AP d20": "M90+AP", "M95+AP d20": "M95+AP", "M95+AP tau0.001": "M95+AP",
           "M95+AP alpha0.3": "M95+AP"}


def arm_dir(out: Path, name: str) -> Path:
    return shared_arm_dir(out, name, ALIASES)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="main", choices=sorted(SUITES))
    ap.add_argument("--out", default="experiments/anchor_priors/results")
    ap.add_argument("--jobs", type=int, default=2, help="arms run in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    ap.add_argument("--set", action="append", default=[], help="override the shared recipe, key=value")
    ap.add_argument("--only", default="", help="comma-separated arm names to run")
    args = ap.parse_args()
    base = {**BASE, **SUITE_BASE.get(args.suite, {})}
    for item in args.set:
        k, v = item.split("=", 1)
        base[k] = v
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = SUITES[args.suite]
    # The whole suite's definition is recorded, whichever of its arms this invocation runs.
    (out / f"suite_{args.suite}.json").write_text(json.dumps({"base": base, "arms": arms, **code_stamp()}, indent=2))
    arms = select(arms, args.only, args.suite)
    run_suite(arms, out, base, args.jobs, args.threads, ALIASES)


if __name__ == "__main__":
    main()
