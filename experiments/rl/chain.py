"""The papers' post-SFT chain at our scale (anchor-priors App. D.2, Table 9; issue 40 item 3): SFT -> DPO -> GSPO
from the Dense and the best compressed SFT arm (Outlier 4b-1b: results/sft_baseline.json), on thinpipe's mesh.

- SFT: ``sft.py``'s runs (60 steps on ``data/sft.jsonl``), under ``--runs``;
- DPO: ``thinpipe train --init-from <SFT run>`` with ``train.objective = dpo`` (``DPO``) on ``data/dpo_train.jsonl``,
  held-out preference accuracy (``final_val_dpo_accuracy``) on the first ``data.val_rows`` pairs of
  ``data/dpo_heldout.jsonl`` (the held-out problems' right solution vs a slip in its last step);
- GSPO: ``gain.py``'s setting from the DPO run (its step-0 ``val_accuracy`` is the DPO model's held-out accuracy).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/chain.py --jobs 2 --gspo-steps 10   # README: 10 GSPO steps
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/eval_heldout.py --model /work/rl_runs/chain_dpo_Dense \\
        --model /work/rl_runs/chain_dpo_Outlier_4b-1b --samples 0 --max-new-tokens 64 \\
        --out experiments/rl/results/chain_heldout.json                 # held-out accuracy after DPO
    .venv/bin/python experiments/rl/chain.py --report       # results/chain.json

Runs are resumable and a finished one is skipped (``gain.run_thinpipe``).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from eval_heldout import stderr  # noqa: E402
from gain import SETTING, run_thinpipe  # noqa: E402
from sft import copy_small, folder_name  # noqa: E402

ARMS = ("Dense", "Outlier 4b-1b")
# DPO (App. D names no DPO setting): TRL's beta 0.1, one pass over the 200 training pairs in 25 steps of 8, a
# constant lr with no warm-up as the GSPO stage, dense boundaries (the post-SFT stages are not the compressed ones)
DPO = {"train.objective": "dpo", "data.name": "experiments/rl/data/dpo_train.jsonl",
       "data.val_name": "experiments/rl/data/dpo_heldout.jsonl", "data.val_rows": 150, "dpo.beta": 0.1,
       "mesh.pp": 4, "model.tied": "untie", "boundary.kind": "identity", "train.batch_size": 8,
       # two microbatches of 4 pairs: the same update (gradients summed), half the activations held at once (the
       # Dense arm's DPO ran with 1 before a run beside three others ran out of memory)
       "train.microbatches": 2,
       "train.seq_len": 192, "train.steps": 25, "train.lr": 5e-6, "train.warmup_ratio": 0.0,
       "train.min_lr_ratio": 1.0, "train.weight_decay": 0.1, "train.grad_clip": 1.0, "eval.every": 0,
       "train.checkpoint_every": 0}


def stages(runs: Path, arm: str) -> tuple[Path, Path, Path]:
    name = folder_name(arm)[len("sft_"):]
    return runs / folder_name(arm), runs / f"chain_dpo_{name}", runs / f"chain_gspo_{name}"


def run_arm(runs: Path, arm: str, gspo_steps: int, dpo_only: bool) -> None:
    sft, dpo, gspo = stages(runs, arm)
    if not (sft / "checkpoint").is_dir():
        raise SystemExit(f"{sft} has no checkpoint: run sft.py first")
    run_thinpipe(sft, dpo, 0, DPO)
    if (dpo / "summary.json").is_file() and not dpo_only:
        run_thinpipe(dpo, gspo, 0, {**SETTING, "train.steps": gspo_steps})


def report(runs: Path) -> None:
    """results/chain.json: per arm, each stage's held-out numbers so far (a stage not run yet is null). Held-out
    accuracy after SFT and after DPO: ``eval_heldout.py`` (HF ``generate``, greedy) in results/sft_baseline.json and
    results/chain_heldout.json; after GSPO: the GSPO run's final ``val_accuracy``."""
    res = HERE / "results"
    base = json.loads((res / "sft_baseline.json").read_text())["results"]
    held_file = res / "chain_heldout.json"
    held = json.loads(held_file.read_text())["results"] if held_file.is_file() else {}
    out = []
    for arm in ARMS:
        sft, dpo, gspo = stages(runs, arm)
        if not (dpo / "summary.json").is_file():
            print(f"[missing] {dpo.name}: not finished")
            continue
        d = json.loads((dpo / "summary.json").read_text())
        g = json.loads((gspo / "summary.json").read_text()) if (gspo / "summary.json").is_file() else None
        n_pairs = DPO["data.val_rows"]
        acc = {"sft": base[sft.name]["greedy_acc"], "dpo": held.get(dpo.name, {}).get("greedy_acc"),
               "gspo": g["final_val_accuracy"] if g else None}
        n = base[sft.name]["n"]
        out.append({"arm": arm, "dpo_steps": d["steps"], "gspo_steps": g["steps"] if g else None,
                    "dpo_val_preference_accuracy": d["final_val_dpo_accuracy"],
                    "dpo_val_preference_stderr": stderr(d["final_val_dpo_accuracy"], n_pairs),
                    "dpo_val_margin": d["final_val_dpo_margin"], "dpo_val_loss": d["final_val_loss"],
                    "n_heldout_pairs": n_pairs, "n_heldout": n,
                    **{f"accuracy_after_{k}": v for k, v in acc.items()},
                    **{f"stderr_after_{k}": None if v is None else stderr(v, n) for k, v in acc.items()}})
        for run in (dpo, gspo):
            if (run / "summary.json").is_file():
                copy_small(run, res / "runs" / run.name)
    (res / "chain.json").write_text(json.dumps([{**r, **code_stamp()} for r in out], indent=1) + "\n")
    show = lambda v: "not run" if v is None else f"{v:.3f}"  # noqa: E731
    for r in out:
        print(f"{r['arm']:14s} held-out accuracy SFT {show(r['accuracy_after_sft'])} -> DPO "
              f"{show(r['accuracy_after_dpo'])} -> GSPO {show(r['accuracy_after_gspo'])}; DPO held-out preference "
              f"accuracy {r['dpo_val_preference_accuracy']:.3f} (n={r['n_heldout_pairs']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="/work/rl_runs", help="where the SFT runs are and the chain's runs go")
    ap.add_argument("--only", default="", help="comma-separated arm names (default: both)")
    ap.add_argument("--gspo-steps", type=int, default=SETTING["train.steps"])
    ap.add_argument("--dpo-only", action="store_true", help="run the DPO stage alone (GSPO on a later call)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="write results/chain.json from finished runs")
    a = ap.parse_args()
    runs = Path(a.runs)
    arms = [x.strip() for x in a.only.split(",") if x.strip()] or ([] if a.report else list(ARMS))
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"--only {arm!r}: choose from {', '.join(ARMS)}")
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        list(pool.map(lambda arm: run_arm(runs, arm, a.gspo_steps, a.dpo_only), arms))
    if a.report:
        report(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
