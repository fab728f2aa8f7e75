"""Table 4 (activation-compression baselines), Table 8 (LoRA composition) and §5.5 (pruning) at
small scale: SmolLM2-135M adapted on MATH, every arm token-matched.

Each arm is one `thinpipe train` run (same data order, steps, tokens, seed); arms run as parallel
processes and finished arms are skipped on a rerun. Then `report.py` builds the tables and plots.

    .venv/bin/python experiments/baselines/run.py --suite table4 --out experiments/baselines/results
    .venv/bin/python experiments/baselines/run.py --suite table8 --out experiments/baselines/results
    .venv/bin/python experiments/baselines/run.py --suite prune  --out experiments/baselines/results
    .venv/bin/python experiments/baselines/run.py --suite generative --out experiments/baselines/results

Recipe: the anchor-priors experiment's (4 stages, 4 x 128 tokens per step, 100 steps, lr 1e-4),
on the first 100 MATH training problems (92 packed rows), so that the 400 rows of a run are ~4
epochs: AQ-SGD only compresses rows it has seen before, and the same data for every arm keeps the
comparison fair. Checkpoints (1.6 GB each) are kept only for the arms the pruning sweep needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import arm_dir, run_suite, select  # noqa: E402

BASE = {"model.name": "smollm2-135m", "data.name": "math", "data.max_examples": 100, "mesh.pp": 4,
        "train.batch_size": 4, "train.seq_len": 128, "train.microbatches": 2, "train.steps": 100,
        "train.lr": 1e-4, "data.val_rows": 32, "eval.every": 20, "model.tied": "untie",
        "train.checkpoint_every": 0}
AP = {"mesh.anchor": 1}
M95 = {"boundary.kind": "mask", "boundary.p": 0.95}
LORA = {"train.lora.rank": 16, "train.lora.alpha": 32, "train.lr": 1e-3}  # LoRA's usual 10x lr

SUITES = {
    # Table 4's rows, in the order the pruning sweep needs them (Dense and M95+AP first).
    "table4": {"Dense": {}, "M95+AP": {**M95, **AP}, "M95": M95,
               "4-bit Quant": {"boundary.kind": "quant4"}, "AQ-SGD 2b-8b": {"boundary.kind": "aqsgd"},
               "TAH-Quant 2b-8b": {"boundary.kind": "tahquant"},
               "Top-K 10x": {"boundary.kind": "topk", "boundary.p": 0.9},
               "Bottleneck 20x": {"boundary.kind": "bottleneck", "boundary.p": 0.95},
               "2-bit Quant": {"boundary.kind": "quant2"},
               # TAH-Quant's bit widths without its Hadamard / outlier / extra-bit parts
               "Quant 2b-8b": {"boundary.kind": "quant2", "boundary.bwd_bits": 8}},
    "table8": {"Dense": {}, "LoRA r16": LORA, "M95+AP": {**M95, **AP}, "LoRA r16 + M95+AP": {**LORA, **M95, **AP},
               # control: LoRA + M95+AP diverges at LoRA's lr 1e-3; is it the lr?
               "LoRA r16 + M95+AP lr 1e-4": {**LORA, **M95, **AP, "train.lr": 1e-4}},
    "smoke": {"Dense": {"train.steps": 2, "eval.every": 1}, "AQ-SGD 2b-8b": {"boundary.kind": "aqsgd",
                                                                               "train.steps": 2, "eval.every": 1}},
}
KEEP_CHECKPOINT = {"Dense", "M95+AP"}   # the pruning sweep's two runs
PRUNE_SPARSITIES = "0,0.1,0.2,0.3,0.4,0.5,0.6"


def prune(out: Path, tasks: str, limit: int) -> None:
    """`thinpipe prune` on the Dense and M95+AP runs of table4."""
    for name in sorted(KEEP_CHECKPOINT):
        run = arm_dir(out, name)
        if (run / "prune" / "prune.json").is_file():
            print(f"[skip] prune {name}: done already", flush=True)
            continue
        if not (run / "checkpoint" / "state.pt").is_file():
            raise SystemExit(f"prune: {run} has no checkpoint; run --suite table4 first "
                             f"(it keeps {sorted(KEEP_CHECKPOINT)})")
        cmd = [sys.executable, "-m", "thinpipe", "prune", "--run", str(run), "--sparsity", PRUNE_SPARSITIES]
        if tasks:
            cmd += ["--tasks", tasks, "--limit", str(limit)]
        print(f"[start] prune {name}", flush=True)
        subprocess.run(cmd, check=True)


GENERATIVE_TASKS = "gsm8k,humaneval,mbpp"
GENERATIVE_MODELS = ["pretrained"] + sorted(KEEP_CHECKPOINT)


def generative_dir(out: Path, name: str) -> Path:
    """Where a model's generative results live: its run folder, or ``pretrained/``."""
    return out / "pretrained" if name == "pretrained" else arm_dir(out, name)


def generative(out: Path, limit: int, jobs: int) -> None:
    """`thinpipe eval` on the generative tasks: the pretrained model and the kept checkpoints."""
    def evaluate(name: str) -> None:
        run = generative_dir(out, name)
        if (run / "generative.json").is_file():
            print(f"[skip] generative {name}: done already", flush=True)
            return
        if name != "pretrained" and not (run / "checkpoint" / "state.pt").is_file():
            raise SystemExit(f"generative: {run} has no checkpoint; run --suite table4 first")
        run.mkdir(parents=True, exist_ok=True)
        model = BASE["model.name"] if name == "pretrained" else str(run)
        cmd = [sys.executable, "-m", "thinpipe", "eval", "--model", model, "--tasks", GENERATIVE_TASKS,
               "--limit", str(limit), "--samples", str(run / "generative_samples.json"), "--json"]
        print(f"[start] generative {name}", flush=True)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode:
            raise SystemExit(f"generative {name} failed (exit {r.returncode})")
        (run / "generative.json").write_text(r.stdout)
        print(f"[done] generative {name}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(evaluate, GENERATIVE_MODELS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="table4", choices=sorted(SUITES) + ["prune", "generative"])
    ap.add_argument("--out", default="experiments/baselines/results")
    ap.add_argument("--jobs", type=int, default=2, help="arms run in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    ap.add_argument("--only", default="", help="comma-separated arm names to run")
    ap.add_argument("--prune-tasks", default="arc_easy", help="MC tasks re-measured by the pruning sweep")
    ap.add_argument("--prune-limit", type=int, default=200)
    ap.add_argument("--generative-limit", type=int, default=20, help="problems per generative task (~10 s each here)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.suite == "prune":
        prune(out, args.prune_tasks, args.prune_limit)
        return
    if args.suite == "generative":
        generative(out, args.generative_limit, args.jobs)
        return
    arms = SUITES[args.suite]
    (out / f"suite_{args.suite}.json").write_text(json.dumps({"base": BASE, "arms": arms, **code_stamp()}, indent=2))
    arms = select(arms, args.only, args.suite)
    run_suite(arms, out, BASE, args.jobs, args.threads)
    for name in arms:
        if name not in KEEP_CHECKPOINT:
            shutil.rmtree(arm_dir(out, name) / "checkpoint", ignore_errors=True)


if __name__ == "__main__":
    main()
