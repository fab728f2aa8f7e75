"""The table and curves of the RL-after-SFT experiment (``run.py``): ``results/rl.json`` (one entry per arm:
held-out accuracy before and after GSPO with its standard error, the gain), ``results/rl_curves.png`` (reward,
clip fraction and held-out accuracy against the step), and the runs' small files under ``results/runs/``.

    .venv/bin/python experiments/rl/report.py [--runs /work/rl_runs]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import load_results, save_figure  # noqa: E402

HERE = Path(__file__).resolve().parent
ARMS = ("Dense", "Outlier 4b-1b", "M95")
VARIANTS = {"Dense, lr 5e-6": "gspo_Dense_lr5e-6"}
SMALL_FILES = ("summary.json", "metrics.jsonl", "config.toml")


def stderr(p: float, n: int) -> float:
    """Standard error of an accuracy over n items (the convention of thinpipe eval: sqrt(p(1-p)/(n-1)))."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def load_arm(folder: Path) -> dict | None:
    """A GSPO run's rows and held-out points: from its summary when finished, else from its metrics rows and the
    newest checkpoint (which holds the step-0 measure); None before its first held-out point after step 0."""
    s = load_results(folder)
    if s is not None:
        s["finished"] = True
        return s
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (folder / "metrics.jsonl").is_file() else []
    parts = sorted(folder.glob("checkpoint/step*/mesh.json"))
    if not rows or not parts:
        return None
    start = json.loads(parts[0].read_text())["state"]["val_points"][0]["__tuple__"]
    points = [tuple(start)] + [(r["step"] + 1, r["val_accuracy"]) for r in rows if "val_accuracy" in r]
    if len(points) < 2:
        return None
    last = points[-1][0]
    rows = [r for r in rows if r["step"] < last]  # the rows the last held-out point measured
    return {"finished": False, "metrics": rows, "val_points": points, "steps": last,
            "initial_val_accuracy": points[0][1], "final_val_accuracy": points[-1][1],
            "rollout_bytes": rows[-1]["rollout_bytes"], "pp_fwd_bytes": rows[-1]["pp_fwd_bytes"],
            "pp_bwd_bytes": rows[-1]["pp_bwd_bytes"], "wall_s": rows[-1]["wall_s"]}


def entry(arm: str, s: dict, n: int) -> dict:
    before, after = s["initial_val_accuracy"], s["final_val_accuracy"]
    se_b, se_a = stderr(before, n), stderr(after, n)
    rows = s["metrics"]
    at20 = dict((int(a), b) for a, b in s["val_points"]).get(20)
    return {"arm": arm, "accuracy_before": before, "accuracy_after": after, "stderr_before": se_b,
            "stderr_after": se_a, "n_heldout": n, "gain": after - before,
            # the two accuracies are of the same items, so this (independent-samples) stderr is conservative
            "gain_stderr": math.sqrt(se_a ** 2 + se_b ** 2), "steps": s["steps"], "finished": s["finished"],
            "accuracy_at_step_20": at20, "val_points": s["val_points"],
            "reward_mean_first_10": sum(r["reward_mean"] for r in rows[:10]) / 10,
            "reward_mean_last_10": sum(r["reward_mean"] for r in rows[-10:]) / 10,
            "clip_fraction_mean": sum(r["clip_fraction"] for r in rows) / len(rows),
            "entropy_mean": sum(r["entropy"] for r in rows) / len(rows),
            "response_len_mean": sum(r["response_len"] for r in rows) / len(rows),
            "gen_tokens_per_s_mean": sum(r["gen_tokens_per_s"] for r in rows) / len(rows),
            "rollout_bytes": s["rollout_bytes"], "pp_bytes": s["pp_fwd_bytes"] + s["pp_bwd_bytes"],
            "wall_s": s["wall_s"]}


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for arm, s in results.items():
        steps = [r["step"] for r in s["metrics"]]
        smooth = lambda k: [sum(r[k] for r in s["metrics"][max(0, i - 4):i + 1]) /  # noqa: E731
                            len(s["metrics"][max(0, i - 4):i + 1]) for i in range(len(steps))]
        axes[0].plot(steps, smooth("reward_mean"), label=f"{arm} (5-step mean)")
        axes[1].plot(steps, smooth("clip_fraction"), label=arm)
        axes[2].plot(*zip(*s["val_points"]), "o-", label=arm)
    for ax, what in zip(axes, ("rollout reward", "clip fraction", "held-out accuracy (greedy)")):
        ax.set_xlabel("GSPO step")
        ax.set_ylabel(what)
    save_figure(fig, axes, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="/work/rl_runs")
    a = ap.parse_args()
    runs = Path(a.runs)
    n = sum(1 for line in (HERE / "data" / "heldout.jsonl").read_text().splitlines() if line.strip())
    results, table = {}, []
    for arm in ARMS:
        folder = runs / f"gspo_{arm.replace(' ', '_')}"
        s = load_arm(folder)
        if s is None:
            print(f"[missing] {arm}: {folder} has no summary.json yet")
            continue
        results[arm] = s
        table.append(entry(arm, s, n))
        dest = HERE / "results" / "runs" / folder.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in SMALL_FILES:
            if (folder / f).is_file():
                shutil.copy2(folder / f, dest / f)
    (HERE / "results" / "rl.json").write_text(json.dumps([{**r, **code_stamp()} for r in table], indent=2))
    variants = []  # the same GSPO run at another setting (not a Table 9 arm): results/rl_variants.json
    for arm, name in VARIANTS.items():
        s = load_arm(runs / name)
        if s is not None:
            variants.append(entry(arm, s, n))
            dest = HERE / "results" / "runs" / name
            dest.mkdir(parents=True, exist_ok=True)
            for f in SMALL_FILES:
                if (runs / name / f).is_file():
                    shutil.copy2(runs / name / f, dest / f)
    (HERE / "results" / "rl_variants.json").write_text(json.dumps([{**r, **code_stamp()} for r in variants],
                                                                  indent=2))
    table = table + variants
    if results:
        plot(results, HERE / "results" / "rl_curves.png")
    print(f"{'arm':<16}{'steps':>6}{'before':>16}{'after':>16}{'gain':>16}{'at 20':>7}{'clip':>7}"
          f"{'reward first/last 10':>22}")
    for e in table:
        at20 = "-" if e["accuracy_at_step_20"] is None else f"{e['accuracy_at_step_20']:.3f}"
        print(f"{e['arm']:<16}{e['steps']:>6}{e['accuracy_before']:>9.3f} ±{e['stderr_before']:.3f}"
              f"{e['accuracy_after']:>9.3f} ±{e['stderr_after']:.3f}{e['gain']:>+9.3f} ±{e['gain_stderr']:.3f}"
              f"{at20:>7}{e['clip_fraction_mean']:>7.3f}{e['reward_mean_first_10']:>12.3f} / "
              f"{e['reward_mean_last_10']:.3f}")
    print(f"n_heldout = {n}; results in {HERE / 'results' / 'rl.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
