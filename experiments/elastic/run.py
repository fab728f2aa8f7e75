"""Elastic replicas, measured: 3 replicas x 2 stages of tiny-llama, one replica SIGKILLed mid-run and restarted.

Two jobs with the same config, one after the other on this machine (``thinpipe launch --elastic``):
  uninterrupted   no failure
  killed          replica 1's stage 1 SIGKILLs itself mid-step at step --kill-at (THINPIPE_ELASTIC_KILL);
                  the launcher restarts the replica, which recovers the job's state from a live peer
and one table (also ``results/elastic.json``): whether it completed, steps redone by the survivors,
replica-steps the job trained without the lost replica, seconds from the kill to training again,
held-out loss at the end, and whether every replica ends with the same weights.

    .venv/bin/python experiments/elastic/run.py            # ~2.5 min on two idle CPU cores
    .venv/bin/python experiments/elastic/run.py --scheme streaming-diloco --kill-replica 0:0   # the first replica
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from thinpipe.checkpoint import load_part, sets
from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent


SCHEMES = {"allreduce": ["--set", "dp.kind=allreduce"],
           "streaming-diloco": ["--set", "dp.kind=streaming-diloco", "--set", "dp.inner_steps=10",
                                "--set", "dp.fragments=2", "--set", "dp.overlap=1"]}


def job(out: Path, args, kill: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill:
        env["THINPIPE_ELASTIC_KILL"] = kill
    cmd = [sys.executable, "-m", "thinpipe", "launch", "--elastic", "--max-restarts", "2", "--", "train", "--out",
           str(out), "--overwrite", "--quiet",
           "--set", "model.name=tiny-llama", "--set", f"data.name={args.data}", "--set", "mesh.dp=3",
           "--set", "mesh.pp=2", "--set", f"train.steps={args.steps}", "--set", "train.batch_size=4",
           "--set", "train.seq_len=128", "--set", "train.microbatches=2", "--set", "train.lr=3e-3",
           "--set", f"eval.every={args.steps // 4}", "--set",
           f"train.checkpoint_every={args.steps // 2}", *SCHEMES[args.scheme]]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"job {out} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    weights = []
    for f in sorted(p for p in out.glob("replica*") if (p / "summary.json").is_file()):
        _, d = sets(f / "checkpoint")[0]
        weights.append([load_part(d, f"rank{r}")["rank"]["stage"] for r in range(2)])
    same = all(torch.equal(w[r][k], weights[0][r][k]) for w in weights for r in range(2) for k in w[r])
    return {"completed": s["replicas_finished"] == 3, "job_wall_s": round(wall, 1),
            "final_val_loss": s["final_val_loss"], "steps_redone": s["steps_redone"],
            "replica_steps_missed": s["replica_steps_missed"],
            "rejoins": s["rejoins"], "restarts": s["restarts"], "tokens": s["tokens"],
            "weights_equal_across_replicas": same, "quorum_changes": s["quorum_changes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-at", type=int, default=60)
    ap.add_argument("--data", default="math")
    ap.add_argument("--runs", default="runs/elastic")
    ap.add_argument("--scheme", choices=sorted(SCHEMES), default="allreduce")
    ap.add_argument("--kill-replica", default="1:1", help="replica:stage to SIGKILL")
    args = ap.parse_args()
    runs = Path(args.runs)
    rows = {"uninterrupted": job(runs / f"{args.scheme}-uninterrupted", args, None),
            "killed": job(runs / f"{args.scheme}-killed", args, f"{args.kill_replica}:{args.kill_at}")}
    a, b = rows["uninterrupted"], rows["killed"]
    print(f"{'job':<14} {'completed':>9} {'redone':>6} {'missed':>6} {'rejoin s':>8} {'at step':>7} {'val loss':>9} "
          f"{'same w':>6} {'wall s':>7}")
    for name, r in rows.items():
        j = r["rejoins"][0] if r["rejoins"] else {}
        print(f"{name:<14} {str(r['completed']):>9} {r['steps_redone']:>6} {r['replica_steps_missed']:>6} "
              f"{j.get('rejoin_s', '-')!s:>8} {j.get('at_step', '-')!s:>7} {r['final_val_loss']:>9.4f} "
              f"{str(r['weights_equal_across_replicas']):>6} {r['job_wall_s']:>7}")
    print(f"held-out loss, killed vs uninterrupted: {100 * (b['final_val_loss'] / a['final_val_loss'] - 1):+.2f}%")
    out = {"config": vars(args), "machine": f"{os.cpu_count()} CPU cores", "rows": rows, **code_stamp()}
    name = "elastic.json" if args.scheme == "allreduce" and args.kill_replica == "1:1" else \
        f"elastic-{args.scheme}-kill{args.kill_replica.replace(':', '.')}.json"
    (HERE / "results" / name).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
