"""Spectral-correction overhead on SmolLM2-135M: filter per step + SVD amortised over delta steps,
relative to a plain training step (forward-backward + AdamW) and to the AdamW update alone.

    .venv/bin/python benchmarks/spectral_overhead.py [--rank 64] [--delta 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thinpipe.config import Config, apply_overrides
from thinpipe.data import batches, build_dataset
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import load_model
from thinpipe.optim.spectral import SpectralCorrection
from thinpipe.provenance import code_stamp


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--delta", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/spectral_overhead.json")
    args = ap.parse_args()
    loaded = load_model(args.model)
    cfg = Config()
    apply_overrides(cfg, {"model.name": args.model, "mesh.pp": 4, "train.batch_size": 4, "train.seq_len": 128,
                          "train.microbatches": 2, "model.tied": "untie", "boundary.kind": "mask"})
    mesh = SimMesh(loaded.model, cfg.validate())
    ds = build_dataset("synthetic" if args.model.startswith("tiny") else "math", loaded.tokenizer, 128, "train", 0, 500)
    stream = batches(ds, 4, seed=0)
    mesh.train_step([next(stream)])  # warm-up
    step_s = timed(lambda: mesh.train_step([next(stream)]), args.repeats)
    mesh.forward_backward([next(stream)])
    opts = [SpectralCorrection(st.named_parameters(), o, rank=args.rank)
            for st, o in zip(mesh.replicas[0], mesh.optimizers[0])]
    grads = [{n: p.grad.clone() for n, p in st.named_parameters()} for st in mesh.replicas[0]]
    saved = [{n: p.detach().clone() for n, p in st.named_parameters()} for st in mesh.replicas[0]]

    def adamw():
        for o in mesh.optimizers[0]:
            o.step()

    def svd():
        for o, g in zip(opts, grads):
            o.receive_prior(g)

    def apply():
        for o in opts:
            o.apply()

    adamw_s = timed(adamw, args.repeats)
    svd_s = timed(svd, max(2, args.repeats // 2))
    apply_s = timed(apply, args.repeats)
    with torch.no_grad():
        for st, s in zip(mesh.replicas[0], saved):
            for n, p in st.named_parameters():
                p.copy_(s[n])
    per_step = apply_s + svd_s / args.delta
    n_mats = sum(len(o.params) for o in opts)
    row = {"model": args.model, "rank": args.rank, "delta": args.delta, "filtered_matrices": n_mats,
           "train_step_s": step_s, "adamw_step_s": adamw_s, "filter_apply_s": apply_s, "svd_per_arrival_s": svd_s,
           "overhead_per_step_s": per_step, "overhead_vs_train_step": per_step / step_s,
           "overhead_vs_adamw_update": per_step / adamw_s, "threads": torch.get_num_threads()}
    print(f"{args.model}: {n_mats} filtered matrices, rank {args.rank}, SVD amortised over delta = {args.delta}")
    print(f"{'train step (fb + AdamW)':<34}{step_s:>9.3f} s")
    print(f"{'AdamW update alone':<34}{adamw_s:>9.3f} s")
    print(f"{'filter apply (every step)':<34}{apply_s:>9.3f} s")
    print(f"{'SVD refresh (per arrival)':<34}{svd_s:>9.3f} s")
    print(f"{'overhead per step':<34}{per_step:>9.3f} s = {100 * per_step / step_s:.1f}% of a train step "
          f"({per_step / adamw_s:.1f}x the AdamW update)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**row, **code_stamp()}, indent=2))


if __name__ == "__main__":
    main()
