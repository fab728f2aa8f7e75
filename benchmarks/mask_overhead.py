"""Masking overhead and bytes per token: dense vs M90/M95 on a 4-stage SmolLM2 mesh, no network.

Steps of the arms are interleaved (dense, M95, dense, M95, ...) so that machine noise hits all
arms alike; the table reports the median step time per arm and its ratio to dense, and the PP
bytes per token counted from the payloads next to the formula 2 (P-1) K b per token.

    .venv/bin/python benchmarks/mask_overhead.py [--steps 8] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thinpipe.boundary import kept_dims
from thinpipe.config import Config, apply_overrides
from thinpipe.data import batches, build_dataset
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import load_model
from thinpipe.provenance import code_stamp

ARMS = {"Dense": {"boundary.kind": "identity"}, "M90": {"boundary.kind": "mask", "boundary.p": 0.90},
        "M95": {"boundary.kind": "mask", "boundary.p": 0.95}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per arm (after 1 warm-up step)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/mask_overhead.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.model)
    data = "synthetic" if args.model.startswith("tiny") else "math"
    ds = build_dataset(data, loaded.tokenizer, args.seq_len, "train", 0, 2000)
    meshes = {}
    for name, arm in ARMS.items():
        cfg = Config()
        apply_overrides(cfg, {"model.name": args.model, "mesh.pp": 4, "train.batch_size": args.batch_size,
                              "train.seq_len": args.seq_len, "train.microbatches": 2, "model.tied": "untie",
                              "train.steps": args.steps + 1, **arm})
        meshes[name] = SimMesh(loaded.model, cfg.validate())
    times: dict[str, list[float]] = {n: [] for n in ARMS}
    stream = batches(ds, args.batch_size, seed=0)
    for step in range(args.steps + 1):
        batch = next(stream)
        for name, mesh in meshes.items():
            t0 = time.perf_counter()
            mesh.train_step([batch])
            if step:  # step 0 is warm-up
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch_size * args.seq_len * (args.steps + 1)
    hidden = loaded.model.config.hidden_size
    rows = []
    dense_t = statistics.median(times["Dense"])
    for name, mesh in meshes.items():
        p = mesh.cfg.boundary.p if mesh.cfg.boundary.kind == "mask" else 0.0
        k = kept_dims(hidden, p) if p else hidden
        bpt = (mesh.meter.totals["pp_fwd"] + mesh.meter.totals["pp_bwd"]) / tokens
        rows.append({"arm": name, "median_step_s": statistics.median(times[name]),
                     "step_time_ratio_vs_dense": statistics.median(times[name]) / dense_t,
                     "pp_bytes_per_token": bpt, "formula_bytes_per_token": 2 * 3 * k * 4,
                     "pp_compression_vs_dense": (2 * 3 * hidden * 4) / bpt, "step_times_s": times[name]})
    print(f"model {args.model}, 4 stages, batch {args.batch_size} x {args.seq_len}, 2 microbatches, "
          f"{args.steps} timed steps per arm (interleaved), fp32, {torch.get_num_threads()} threads")
    print(f"{'arm':<7}{'median step s':>14}{'ratio':>8}{'PP B/token':>12}{'formula':>9}{'compression':>13}")
    for r in rows:
        print(f"{r['arm']:<7}{r['median_step_s']:>14.3f}{r['step_time_ratio_vs_dense']:>8.3f}"
              f"{r['pp_bytes_per_token']:>12.1f}{r['formula_bytes_per_token']:>9.0f}{r['pp_compression_vs_dense']:>12.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, **code_stamp()}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
