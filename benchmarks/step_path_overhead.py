"""What one step path costs (issue 37): the same ``--engine dist`` SFT job (tiny-llama, 2 replicas x 2 stages,
200 steps) on the commit before it (fb12daf, checked out at /tmp/old) and on this tree, twice each, alternating;
ms per step from summary.json's wall_s, and whether the losses are bitwise equal. The step path adds one small
all-gather per step (the objective's loss through ``Pipe.sum_stats``). Writes
``benchmarks/results/step_path_overhead.json``.

    git worktree add /tmp/old fb12daf && .venv/bin/python benchmarks/step_path_overhead.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
OLD = Path("/tmp/old")
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
    res = {"old": [], "new": []}
    for rep in range(2):
        for arm, root in (("old", OLD), ("new", ROOT)):
            res[arm].append(job(root))
            print(arm, rep, f"{res[arm][-1]['step_s'] * 1000:.2f} ms/step", flush=True)
    equal = all(a["losses"] == b["losses"] for a, b in zip(res["old"], res["new"]))
    old, new = (sum(r["step_s"] for r in res[a]) / 2 for a in ("old", "new"))
    print(f"| old | new | new / old | losses equal |\n|---|---|---|---|\n"
          f"| {old * 1000:.2f} ms | {new * 1000:.2f} ms | {new / old:.3f} | {equal} |")
    out = {"settings": SETTINGS, "old_commit": "fb12daf", "old_ms": old * 1000, "new_ms": new * 1000,
           "ratio": new / old, "losses_equal": equal, **code_stamp()}
    (ROOT / "benchmarks" / "results" / "step_path_overhead.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
