"""Table 9 at our scale (anchor-priors App. D): the same GSPO run from each SFT arm (Dense, Outlier 4b-1b, M95;
``sft.py``), held-out accuracy before and after RL.

Each GSPO arm is one ``thinpipe train --init-from <its SFT run>`` process with the same settings (the only
difference between arms is where they start): rollouts on the mesh (4 stages, dense boundaries: the paper's RL
phase is not the compressed one; Table 9 asks what the compressed SFT left behind), a reward of 1 for a correct
final number, GRPO advantages, GSPO's sequence-level ratio with the paper's clip range. The held-out measure
is ``val_accuracy``: greedy decoding (96 new tokens) of the 300 held-out problems (``data/heldout.jsonl``,
never trained on), at step 0 (= the SFT arm's accuracy, before RL), every ``eval.every`` steps and at the end.
Runs are resumable: a run folder with a checkpoint continues (``--resume``), a finished one is skipped.

Deviations from App. D, sized to 2 CPU cores: 40 steps x 4 prompts x 4 rollouts (the paper: 32 x 16 for 2
epochs), 96 new tokens (7,680), no overlong shaping (responses are short), 2 minibatches per step (the paper:
32), and lr 2e-5 (the paper's 1e-6 barely moves a 135M model in 40 steps; ``--lr`` to change it).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/run.py [--jobs 2] [--steps 40] [--lr 2e-5]
    .venv/bin/python experiments/rl/report.py      # results/rl.json, results/rl_curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARMS = ("Dense", "Outlier 4b-1b", "M95")

GSPO = {"train.objective": "gspo", "data.name": "experiments/rl/data/rl_train.jsonl",
        "data.val_name": "experiments/rl/data/heldout.jsonl", "data.val_rows": 0,
        "mesh.pp": 4, "model.tied": "untie", "boundary.kind": "identity",
        "rl.group_size": 4, "rl.prompts_per_step": 4, "rl.minibatches": 2, "rl.max_response_tokens": 96,
        "rl.temperature": 1.0, "train.seq_len": 256, "train.batch_size": 8,
        "train.warmup_ratio": 0.05, "train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.min_lr_ratio": 1.0,
        "eval.every": 20, "train.checkpoint_every": 10}


def arm_folder(runs: Path, prefix: str, arm: str) -> Path:
    return runs / f"{prefix}_{arm.replace(' ', '_')}"


def run_gspo(arm: str, runs: Path, steps: int, lr: float, threads: int, suffix: str = "") -> dict:
    sft, out = arm_folder(runs, "sft", arm), arm_folder(runs, "gspo", arm + suffix)
    if (out / "summary.json").is_file():
        print(f"[skip] {arm}: done already", flush=True)
        return json.loads((out / "summary.json").read_text())
    if not (sft / "summary.json").is_file():
        raise SystemExit(f"{sft} has no finished SFT run: run experiments/rl/sft.py first")
    resume = (out / "checkpoint").is_dir()
    args = [sys.executable, "-m", "thinpipe", "train", "--out", str(out), "--quiet"]
    args += ["--resume"] if resume else ["--overwrite", "--init-from", str(sft)]
    for k, v in {**GSPO, "train.steps": steps, "train.lr": lr}.items():
        args += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[{'resume' if resume else 'start'}] GSPO from {arm}", flush=True)
    with open(out / "log.txt", "a" if resume else "w") as log:
        r = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode:
        print(f"[fail] {arm}: exit {r.returncode}, see {out / 'log.txt'}", flush=True)
        return {}
    print(f"[done] GSPO from {arm} in {time.time() - t0:.0f} s", flush=True)
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="/work/rl_runs", help="where the SFT runs are and the GSPO runs go")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--jobs", type=int, default=2, help="arms at once (one thread each)")
    ap.add_argument("--only", default="", help="comma-separated arm names")
    ap.add_argument("--suffix", default="", help="appended to the GSPO folders' names (a variant, e.g. _lr5e-6)")
    a = ap.parse_args()
    arms = [x.strip() for x in a.only.split(",")] if a.only else list(ARMS)
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda arm: run_gspo(arm, Path(a.runs), a.steps, a.lr, 1, a.suffix), arms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
