"""What a change of the step path costs: the same ``--engine dist`` SFT job (tiny-llama, 2 replicas x 2 stages,
200 steps) on an older commit (checked out at ``--old-root``) and on this tree, twice each, alternating; ms per
step from summary.json's wall_s, and whether the losses are bitwise equal.

Issue 37 (one step path: one small all-gather per step, the objective's loss through ``Pipe.sum_stats``) against
fb12daf, all-reduce: ``benchmarks/results/step_path_overhead.json``. Issue 49 (the loop drives the objective, DP
schemes behind one interface) against 564f681, one file per DP scheme (``--dp``):
``benchmarks/results/step_path_overhead_issue49_<dp>.json``.

    git worktree add /tmp/old fb12daf && .venv/bin/python benchmarks/step_path_overhead.py
    git worktree add /tmp/old49 564f681 && .venv/bin/python benchmarks/step_path_overhead.py --old-root /tmp/old49 \
        --old-commit 564f681 --dp diloco --out benchmarks/results/step_path_overhead_issue49_diloco.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["model.name=tiny-llama", "data.name=synthetic", "mesh.dp=2", "mesh.pp=2", "dp.kind=allreduce",
            "train.steps=200", "train.batch_size=4", "train.seq_len=128", "train.microbatches=2",
            "train.checkpoint_every=0", "eval.every=0"]


def job(root: Path) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "thinpipe", "launch", "--nproc", "4", "--", "train", "--out", f"{d}/o",
               "--quiet", *[x for s in SETTINGS for x in ("--set", s)]]
        p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
                           capture_output=True, text=True, cwd=root)
        if p.returncode:
            sys.exit(f"the job at {root} failed:\n{p.stderr[-2000:]}")
        s = json.loads(Path(f"{d}/o/summary.json").read_text())
        rows = [json.loads(line) for line in Path(f"{d}/o/metrics.jsonl").read_text().splitlines()]
        return {"step_s": s["wall_s"] / 200, "losses": [r["loss"] for r in rows]}


def main() -> None:
    global SETTINGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-root", default="/tmp/old", help="a checkout of the older commit")
    ap.add_argument("--old-commit", default="fb12daf")
    ap.add_argument("--dp", default="allreduce", help="dp.kind of the job (diloco: dp.inner_steps=10)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_path_overhead.json"))
    args = ap.parse_args()
    SETTINGS = [s if not s.startswith("dp.kind=") else f"dp.kind={args.dp}" for s in SETTINGS]
    res: dict[str, list] = {"old": [], "new": []}
    for rep in range(2):
        for arm, root in (("old", Path(args.old_root)), ("new", ROOT)):
            res[arm].append(job(root))
            print(arm, rep, f"{res[arm][-1]['step_s'] * 1000:.2f} ms/step", flush=True)
    equal = all(a["losses"] == b["losses"] for a, b in zip(res["old"], res["new"]))
    old, new = (sum(r["step_s"] for r in res[a]) / 2 for a in ("old", "new"))
    print(f"| old | new | new / old | losses equal |\n|---|---|---|---|\n"
          f"| {old * 1000:.2f} ms | {new * 1000:.2f} ms | {new / old:.3f} | {equal} |")
    out = {"settings": SETTINGS, "old_commit": args.old_commit, "old_ms": old * 1000, "new_ms": new * 1000,
           "ratio": new / old, "losses_equal": equal, **code_stamp()}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
