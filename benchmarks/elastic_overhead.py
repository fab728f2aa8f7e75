"""What elasticity costs when nothing fails: the same job under ``--engine dist`` and ``--elastic``.

Per step an elastic replica asks torchft for a quorum, snapshots its stage's training state in host
memory, runs one extra collective (who took part, losses, bytes) and asks ``should_commit``
(docs/elastic.md). This runs one job both ways, one after the other (``thinpipe launch --nproc`` and
``thinpipe launch --elastic``, tiny-llama, 2 replicas x 2 stages, all-reduce DP) and compares the
training loop's wall time (``summary.json: wall_s``, which leaves out process start-up), as a ratio.
The losses must be equal (the two are bitwise the same run). Writes
``benchmarks/results/elastic_overhead.json``.

    .venv/bin/python benchmarks/elastic_overhead.py [--steps 200] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "elastic_overhead.json"


def job(kind: str, out: Path, args) -> dict:
    settings = ["model.name=tiny-llama", "data.name=synthetic", "mesh.dp=2", "mesh.pp=2", "dp.kind=allreduce",
                f"train.steps={args.steps}", "train.batch_size=4", f"train.seq_len={args.seq_len}",
                "train.microbatches=2", "train.checkpoint_every=0", "eval.every=0"]
    launcher = ["--nproc", "4"] if kind == "dist" else ["--elastic"]
    cmd = [sys.executable, "-m", "thinpipe", "launch", *launcher, "--", "train", "--out", str(out), "--quiet",
           *[x for s in settings for x in ("--set", s)]]
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{kind} job failed:\n{p.stderr[-3000:]}")
    folder = out if kind == "dist" else out / "replica0"
    s = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": s["wall_s"], "step_s": s["wall_s"] / args.steps, "losses": [r["loss"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {kind: job(kind, Path(tmp) / kind, args) for kind in ("dist", "elastic")}
    same = res["dist"]["losses"] == res["elastic"]["losses"]
    ratio = res["elastic"]["step_s"] / res["dist"]["step_s"]
    print(f"{'engine':<8} {'train loop s':>12} {'per step ms':>11}")
    for kind, r in res.items():
        print(f"{kind:<8} {r['wall_s']:>12.2f} {1000 * r['step_s']:>11.1f}")
    print(f"elastic / dist per step: {ratio:.2f}x (+{1000 * (res['elastic']['step_s'] - res['dist']['step_s']):.1f} "
          f"ms per step); losses bitwise equal: {same}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"config": vars(args), "machine": f"{os.cpu_count()} CPU cores", "ratio": ratio,
                                   "losses_equal": same, **{k: {"wall_s": v["wall_s"], "step_s": v["step_s"]}
                                                            for k, v in res.items()}, **code_stamp()}, indent=2))


if __name__ == "__main__":
    main()
