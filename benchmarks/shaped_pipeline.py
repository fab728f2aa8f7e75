"""Tokens/s of real processes over shaped links: where the pipe, not compute, sets the pace.

Each arm is a `thinpipe launch` run (gloo, one process per stage and replica) of the tiny Llama
with every PP link shaped to ``--pp-mbps`` (+ ``--latency-ms``) and DP links to ``--dp-mbps``, so
communication dominates; the table gives tokens/s, its ratio to Dense, PP, DP and anchor bytes per token,
the held-out loss (which shaping never changes: it only delays) and, for the anchor arms (one
anchor row of processes, ``anchor.delivery = arrival``, pull/push links shaped like DP links),
the priors consumed and their realised staleness in fast steps.

    .venv/bin/python benchmarks/shaped_pipeline.py [--steps 120] [--pp-mbps 4] [--dp-mbps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = {"model.name": "tiny-llama", "data.name": "synthetic", "mesh.pp": 2, "train.batch_size": 4,
        "train.seq_len": 64, "train.microbatches": 2, "train.lr": 1e-3, "train.checkpoint_every": 0}
ARMS = {
    "Dense": {},
    "M95": {"boundary.kind": "mask", "boundary.p": 0.95},
    "TopK95": {"boundary.kind": "topk", "boundary.p": 0.95},
    "MAPL r16": {"boundary.kind": "mapl", "boundary.rank": 16},
    "Dense, 2 replicas": {"mesh.dp": 2},
    "M95 + PowerSGD r4, 2 replicas": {"boundary.kind": "mask", "boundary.p": 0.95, "mesh.dp": 2,
                                      "dp.kind": "powersgd", "dp.rank": 4, "dp.start_step": 0},
}
# The anchor circuit as its own row of processes: a cycle starts every 4 fast steps (delta = 4 for
# the fixed rule; ``arrival`` consumes each prior as soon as it is there and never waits).
AP = {"mesh.anchor": 1, "anchor.staleness": 4, "anchor.delivery": "arrival"}
ARMS["M95+AP"] = {**ARMS["M95"], **AP}
ARMS["M95+AP, push r4"] = {**ARMS["M95"], **AP, "anchor.push_rank": 4}
ARMS["M95+AP + PowerSGD r4, 2 replicas"] = {**ARMS["M95 + PowerSGD r4, 2 replicas"], **AP, "anchor.push_rank": 4}


def run(name: str, sets: dict, args, out: Path) -> dict:
    cfg = {**BASE, **sets, "train.steps": args.steps, "link.pp_mbps": args.pp_mbps,
           "link.pp_latency_ms": args.latency_ms, "link.dp_mbps": args.dp_mbps}
    nproc = cfg["mesh.pp"] * (cfg.get("mesh.dp", 1) + cfg.get("mesh.anchor", 0))
    folder = out / name.replace(" ", "_").replace(",", "").replace("+", "p")
    cmd = [sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train", "--out", str(folder),
           "--quiet"] + [x for k, v in cfg.items() for x in ("--set", f"{k}={v}")]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-2000:]}")
    return json.loads((folder / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--pp-mbps", type=float, default=4.0)
    ap.add_argument("--dp-mbps", type=float, default=4.0)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--out", default="benchmarks/results/shaped_pipeline.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in ARMS.items():
            results[name] = run(name, sets, args, Path(tmp))
            print(f"done {name}", flush=True)
    dense = results["Dense"]["tokens_per_s"]
    head = (f"{'arm':<34}{'tok/s':>8}{'vs Dense':>10}{'PP B/tok':>10}{'DP B/tok':>10}{'anc B/tok':>11}"
            f"{'held-out':>10}{'priors':>8}{'stale':>7}")
    print(head + "\n" + "-" * len(head))
    rows = {}
    for name, s in results.items():
        b = s["bytes_per_token"]
        pp = b["pp_fwd"] + b["pp_bwd"] + b["pp_params"]
        rows[name] = {"tokens_per_s": s["tokens_per_s"], "ratio_vs_dense": s["tokens_per_s"] / dense,
                      "pp_bytes_per_token": pp, "dp_bytes_per_token": b["dp"], "anchor_bytes_per_token": b["anchor"],
                      "final_val_loss": s["final_val_loss"], "wall_s": s["wall_s"],
                      "priors_consumed": s.get("priors_consumed"), "anchor_staleness_mean": s.get("anchor_staleness_mean"),
                      "anchor_staleness_max": s.get("anchor_staleness_max"), "anchor_wait_s": s.get("anchor_wait_s")}
        stale = s.get("anchor_staleness_mean")
        print(f"{name:<34}{s['tokens_per_s']:>8.0f}{s['tokens_per_s'] / dense:>9.2f}x{pp:>10.0f}{b['dp']:>10.0f}"
              f"{b['anchor']:>11.0f}{s['final_val_loss']:>10.4f}{s.get('priors_consumed', '-'):>8}"
              f"{'-' if stale is None else f'{stale:.1f}':>7}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "base": BASE, "arms": ARMS, "results": rows}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
