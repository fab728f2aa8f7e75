"""``mesh.split = "auto"`` against the balanced split on an emulated uneven mesh (issue 54).

Four real processes (``thinpipe launch --nproc 4``, 4 stages of ``small-llama``: 8 decoder layers), rank 2's compute
made ``--factor`` times as long by ``THINPIPE_SLOW_RANK=2:factor`` (its forward and backward sleep that much longer,
in training and in the start-up measurement alike: a slower GPU). The balanced split gives every stage 2 layers; the
automatic one measures and moves layers off the slow rank. Arms alternate, ``--repeats`` times each; a step's time is
the mean of the steps after the first (``metrics.jsonl``'s ``wall_s`` differences). Also recorded: the split chosen,
each rank's mean compute and waits (``ranks.jsonl``) and the slowest rank the summary names. Run it with nothing else
on the machine.

    .venv/bin/python benchmarks/uneven_split.py            # -> benchmarks/results/uneven_split.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.config import load_config
from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.name=small-llama", "data.name=synthetic", "mesh.pp=4", "train.batch_size=8", "train.seq_len=128",
        "train.microbatches=4", "train.checkpoint_every=0", "eval.every=0"]


def job(split: str, factor: float, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run"
        sets = [x for s in [*BASE, f"train.steps={steps}", *([f"mesh.split={split}"] if split else [])]
                for x in ("--set", s)]
        env = {**os.environ, "THINPIPE_SLOW_RANK": f"2:{factor}", "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "4", "--", "train", "--out",
                            str(out), "--quiet", *sets], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-3000:])
        walls = [json.loads(x)["wall_s"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        ranks = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        per_rank = {}
        for row in ranks:
            if row["step"] == 0:
                continue  # the first step warms up
            p = per_rank.setdefault(row["rank"], {"compute_s": [], "wait_s": []})
            p["compute_s"].append(row["compute_s"])
            p["wait_s"].append(sum(row["wait_s"].values()))
        return {"split": load_config(out / "config.toml").mesh.split or [2, 2, 2, 2],
                "step_s": statistics.mean(b - a for a, b in zip(walls[:-1], walls[1:])),
                "slowest_rank": summary["slowest_rank"],
                "ranks": {r: {k: statistics.mean(v) for k, v in p.items()} for r, p in sorted(per_rank.items())},
                "split_auto": summary.get("split_auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "uneven_split.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"balanced": [], "auto": []}
    for i in range(args.repeats):
        for arm, split in (("balanced", ""), ("auto", "auto")) if i % 2 == 0 else (("auto", "auto"), ("balanced", "")):
            runs[arm].append(job(split, args.factor, args.steps))
            print(f"{arm:9s} split {runs[arm][-1]['split']}  step {runs[arm][-1]['step_s']:.3f} s", flush=True)
    mean = {arm: statistics.mean(r["step_s"] for r in rs) for arm, rs in runs.items()}
    result = {"setting": {"model": "small-llama (8 layers)", "stages": 4, "slow_rank": 2, "factor": args.factor,
                          "steps": args.steps, "sets": BASE},
              "runs": runs, "mean_step_s": mean, "speedup_auto_over_balanced": mean["balanced"] / mean["auto"],
              **code_stamp()}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'arm':9s} {'split':14s} {'step s':>8s}")
    for arm, rs in runs.items():
        print(f"{arm:9s} {str(rs[0]['split']):14s} {mean[arm]:8.3f}")
    print(f"auto / balanced step time: {mean['auto'] / mean['balanced']:.3f} (rank 2 x{args.factor:g})")


if __name__ == "__main__":
    main()
