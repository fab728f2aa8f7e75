"""A GSPO gain from an SFT start, on thinpipe's mesh and through TRL (issue 40, items 1, 2 and 4).

thinpipe: ``thinpipe train --init-from <SFT run>`` with ``train.objective = gspo`` (``SETTING``), one process per
seed; held-out accuracy before / after = the run's ``val_accuracy`` at step 0 / at the end (greedy decoding of the
300 held-out problems on the mesh). TRL: ``trl_gspo.py`` with the same setting (``GRPOTrainer``,
``importance_sampling_level = "sequence"``). Both read ``data/rl_train.jsonl`` and score ``data/heldout.jsonl``.

The gain runs (README "Issue 40"): the start is the flawed demonstrator's SFT (``make_data.py`` writes
``data/sft_noisy.jsonl``: half of the two-step solutions stop after their first step):

    .venv/bin/python experiments/rl/make_data.py
    .venv/bin/python experiments/rl/sft.py --steps 60 --only Dense --suffix _noisy \\
        --data experiments/rl/data/sft_noisy.jsonl --threads 2
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/gain.py --run thinpipe:0 --run thinpipe:1 --run trl:0 --jobs 3
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/eval_heldout.py --model /work/rl_runs/sft_Dense_noisy \\
        --model /work/rl_runs/gain_sft_Dense_noisy_thinpipe_s0 --model /work/rl_runs/gain_sft_Dense_noisy_thinpipe_s1 \\
        --samples 0 --max-new-tokens 64 --out experiments/rl/results/gain_heldout.json   # HF generate, item by item
    .venv/bin/python experiments/rl/gain.py --report      # results/gain.json, results/gain_curves.png

The screen from the clean 60-step SFT (``--init sft_Dense``) and a 12-step one; the first four ran 4 prompts a step
and 2 updates (``rl.prompts_per_step = 4``, ``rl.minibatches = 2``), each run's whole setting is in
``results/runs/screen_*/config.toml``:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/gain.py --init sft_Dense --steps 40 --lr 1e-5 --run thinpipe:0
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/sft.py --steps 12 --only Dense --suffix _12steps
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/gain.py --init sft_Dense_12steps --steps 30 --lr 1e-5 \\
        --run thinpipe:0 --run thinpipe:1 --run trl:0 --jobs 3      # stopped after 11-14 steps
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/gain.py --init sft_Dense_12steps --steps 20 --lr 5e-5 \\
        --run thinpipe:0 --run thinpipe:1 --run trl:0 --jobs 3      # seed 1 and TRL stopped after 7-9 steps
    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/gain.py --init sft_Dense --steps 30 \\
        --run thinpipe:0 --run thinpipe:1 --run trl:0               # today's setting; stopped at step 15-16 (held-out
                                                                    # 0.410 / 0.397 at step 15), TRL at 9

Runs go to ``--runs``/gain_<start>_<trainer>_s<seed>; they are resumable (a thinpipe folder with a checkpoint
continues; a finished one is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from eval_heldout import stderr  # noqa: E402  (the held-out accuracy's stderr, one definition)
from sft import copy_small  # noqa: E402

ROOT = HERE.parents[1]

# The setting both trainers run (trl_gspo.py maps each key to its GRPOConfig field). Groups of 8 (a third of the
# groups of 4 carry no advantage, group_spread.py); 8 prompts and one update a step, because a step's gradient is
# mostly noise (grad_snr.py: two independent 64-rollout gradients have cosine ~0.02), so an update should average
# as many rollouts as a step can afford; on-policy (one update: GSPO's clip never acts, as TRL's num_iterations 1).
STEPS, LR, GROUP, PROMPTS, MINIBATCHES, MAX_NEW = 20, 2e-5, 8, 8, 1, 64
SETTING = {"train.objective": "gspo", "data.name": "experiments/rl/data/rl_train.jsonl",
           "data.val_name": "experiments/rl/data/heldout.jsonl", "data.val_rows": 0,
           "mesh.pp": 4, "model.tied": "untie", "boundary.kind": "identity",
           "rl.group_size": GROUP, "rl.prompts_per_step": PROMPTS, "rl.minibatches": MINIBATCHES,
           "rl.max_response_tokens": MAX_NEW, "rl.temperature": 1.0, "train.seq_len": 192, "train.batch_size": 8,
           "train.warmup_ratio": 0.0, "train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.min_lr_ratio": 1.0,
           "eval.every": 0, "train.checkpoint_every": 10, "train.steps": STEPS, "train.lr": LR}


def run_thinpipe(init: Path, out: Path, seed: int, setting: dict | None = None) -> None:
    """One ``thinpipe train --init-from init`` run into ``out`` (``setting``, default ``SETTING``, with its seed)."""
    if (out / "summary.json").is_file():
        print(f"[skip] {out.name}: done already", flush=True)
        return
    resume = (out / "checkpoint").is_dir()
    args = [sys.executable, "-m", "thinpipe", "train", "--out", str(out), "--quiet"]
    args += ["--resume"] if resume else ["--overwrite", "--init-from", str(init)]
    for k, v in {**(SETTING if setting is None else setting), "train.seed": seed}.items():
        args += ["--set", f"{k}={v}"]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[{'resume' if resume else 'start'}] {out.name}", flush=True)
    with open(out / "log.txt", "a" if resume else "w") as log:
        r = subprocess.run(args, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"[{'fail' if r.returncode else 'done'}] {out.name} in {time.time() - t0:.0f} s", flush=True)


def run_trl(init: Path, out: Path, seed: int, steps: int = STEPS, lr: float = LR) -> None:
    if (out / "result.json").is_file():
        print(f"[skip] {out.name}: done already", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(HERE / "trl_gspo.py"), "--init", str(init), "--out", str(out), "--seed", str(seed),
            "--steps", str(steps), "--lr", str(lr), "--group", str(GROUP), "--prompts", str(PROMPTS),
            "--minibatches", str(MINIBATCHES), "--max-new", str(MAX_NEW)]
    t0 = time.time()
    print(f"[start] {out.name}", flush=True)
    with open(out / "log.txt", "w") as log:
        r = subprocess.run(args, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"[{'fail' if r.returncode else 'done'}] {out.name} in {time.time() - t0:.0f} s", flush=True)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def thinpipe_row(folder: Path, seed: int) -> dict:
    s = json.loads((folder / "summary.json").read_text())
    n = sum(1 for x in (ROOT / SETTING["data.val_name"]).read_text().splitlines() if x.strip())
    before, after = s["initial_val_accuracy"], s["final_val_accuracy"]
    return {"trainer": "thinpipe", "seed": seed, "accuracy_before": before, "accuracy_after": after,
            "stderr_after": stderr(after, n), "n_heldout": n, "run": folder.name}


def trl_row(folder: Path) -> dict:
    r = json.loads((folder / "result.json").read_text())
    return {"trainer": "trl", "seed": r["seed"], "accuracy_before": r["before"]["accuracy"],
            "accuracy_after": r["after"]["accuracy"], "stderr_after": r["after"]["stderr"],
            "n_heldout": r["after"]["n"], "run": folder.name}


def paired(rows: list[dict], init: str, held: Path) -> None:
    """Add to each thinpipe row the independent HF ``generate`` measure of its start and its end (``held``, written by
    ``eval_heldout.py``, when it exists): accuracy, per template, and the item-by-item change (paired: the same
    300 problems before and after, so the change's stderr is that of the per-item differences)."""
    if not held.is_file():
        return
    res = json.loads(held.read_text())["results"]
    if "correct" not in res.get(init, {}):  # no start, or one measured before items were recorded
        return
    b = [int(c) for c in res[init]["correct"]]
    for r in rows:
        if r["trainer"] != "thinpipe" or "correct" not in res.get(r["run"], {}):
            continue
        a = [int(c) for c in res[r["run"]]["correct"]]
        d = [x - y for x, y in zip(a, b)]
        mean = sum(d) / len(d)
        var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
        r["hf_generate"] = {"accuracy_before": sum(b) / len(b), "accuracy_after": sum(a) / len(a),
                            "items_gained": d.count(1), "items_lost": d.count(-1),
                            "paired_stderr_change": (var / len(d)) ** 0.5,
                            "per_template_before": res[init]["per_template"],
                            "per_template_after": res[r["run"]]["per_template"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="/work/rl_runs", help="where the SFT runs are and the GSPO runs go")
    ap.add_argument("--init", default="sft_Dense_noisy", help="the SFT run (under --runs) both trainers start from")
    ap.add_argument("--steps", type=int, default=STEPS, help="GSPO steps (generations)")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--report-to", default="results/gain.json", help="under experiments/rl; the plot beside it")
    ap.add_argument("--run", action="append", default=[], help="thinpipe:SEED or trl:SEED; repeatable")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="write results/gain.json and the plot from finished runs")
    a = ap.parse_args()
    runs, init = Path(a.runs), Path(a.runs) / a.init
    jobs = []
    for spec in a.run:
        kind, _, seed = spec.partition(":")
        if kind not in ("thinpipe", "trl") or not seed.isdigit():
            raise SystemExit(f"--run {spec!r}: give thinpipe:SEED or trl:SEED")
        out = runs / f"gain_{a.init}_{kind}_s{seed}"
        setting = {**SETTING, "train.steps": a.steps, "train.lr": a.lr}
        jobs.append((lambda o=out, s=int(seed): run_thinpipe(init, o, s, setting)) if kind == "thinpipe" else
                    (lambda o=out, s=int(seed): run_trl(init, o, s, a.steps, a.lr)))
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        list(pool.map(lambda f: f(), jobs))
    if a.report:
        report(runs, a.init, HERE / a.report_to)
    return 0


def report(runs: Path, init: str, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, curves = [], []
    for f in sorted(runs.glob(f"gain_{init}_thinpipe_s*")):
        if (f / "summary.json").is_file():
            seed = int(f.name.rsplit("_s", 1)[1])
            rows.append(thinpipe_row(f, seed))
            copy_small(f, dest.parent / "runs" / f.name)
            m = [json.loads(x) for x in (f / "metrics.jsonl").read_text().splitlines() if x.strip()]
            curves.append((f"thinpipe seed {seed}", [r["step"] + 1 for r in m], [r["reward_mean"] for r in m],
                           rows[-1]))
    for f in sorted(runs.glob(f"gain_{init}_trl_s*")):
        if (f / "result.json").is_file():
            rows.append(trl_row(f))
            (dest.parent / "runs" / f.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f / "result.json", dest.parent / "runs" / f.name / "result.json")
            res = json.loads((f / "result.json").read_text())
            pts = [(h["step"], h["reward"]) for h in res["log"] if "reward" in h]
            gens = [-(-s // MINIBATCHES) for s, _ in pts]  # TRL's step counts updates from 1: its generation
            curves.append((f"TRL GRPOTrainer seed {res['seed']}", gens, [r for _, r in pts], rows[-1]))
    for r in rows:
        r["start"] = init
    paired(rows, init, dest.with_name(dest.stem + "_heldout.json"))
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps([{**r, **code_stamp()} for r in rows], indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, x, y, row in curves:
        k = 5  # a 5-generation running mean: one generation is PROMPTS x GROUP rollouts
        ys = [sum(y[max(0, i - k + 1):i + 1]) / len(y[max(0, i - k + 1):i + 1]) for i in range(len(y))]
        ax.plot(x, ys, label=f"{label}: held-out {row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f}")
    ax.set_xlabel(f"generation ({PROMPTS * GROUP} rollouts, {MINIBATCHES} update(s))")
    ax.set_ylabel("rollout reward (5-step mean)")
    ax.set_title(f"GSPO from the SFT start {init}: thinpipe vs TRL")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest.with_name(dest.stem + "_curves.png"), dpi=120)
    for r in rows:
        print(f"{r['trainer']:8s} seed {r['seed']}: {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} "
              f"(+-{r['stderr_after']:.3f}, n={r['n_heldout']})")


if __name__ == "__main__":
    raise SystemExit(main())
