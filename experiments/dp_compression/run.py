"""DP compression at equal tokens: held-out loss vs DP bytes per token (paper §3.3, App. J).

Model: the random-init ``tiny-llama`` (vocab 512, hidden 64, 4 layers) trained from scratch on the
MATH corpus through the byte-level tokenizer, 4 fast replicas x 2 stages. Why tiny: DP
compression's effect shows in *how well replicas that rarely or coarsely sync still learn*, which
needs hundreds of steps per arm; SmolLM2 takes ~4-8 s per replica-step on this CPU, the tiny model
~0.05 s, so every arm gets 300 steps here instead of a handful. Second part: the paper's Table 1
system (M95+AP with compressed DP) against Dense + exact DP and "+DP" (dense PP, compressed DP).

    .venv/bin/python experiments/dp_compression/run.py [--steps 400] [--out experiments/dp_compression/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib

from thinpipe.provenance import code_stamp

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from thinpipe.config import Config, apply_overrides  # noqa: E402
from thinpipe.engine.sim_engine import train  # noqa: E402

BASE = {"model.name": "tiny-llama", "data.name": "math", "mesh.pp": 2, "mesh.dp": 4, "train.batch_size": 4,
        "train.seq_len": 128, "train.lr": 3e-3, "train.warmup_ratio": 0.05, "train.grad_clip": 1.0,
        "data.val_rows": 64, "train.checkpoint_every": 0}
PSGD = {"dp.rank": 4}
COMPRESSED_DP = {"dp.kind": "streaming-diloco", "dp.inner_steps": 10, "dp.fragments": 2, "dp.overlap": 1,
                 "dp.alpha": 0.5, **PSGD}
ARMS = {
    "all-reduce": {},
    "PowerSGD r4": {"dp.kind": "powersgd", "dp.start_step": 10, **PSGD},
    "DiLoCo H10": {"dp.kind": "diloco", "dp.inner_steps": 10},
    "DiLoCo H10 + PowerSGD r4": {"dp.kind": "diloco", "dp.inner_steps": 10, **PSGD},
    "Streaming DiLoCo H10 F2 tau1": {"dp.kind": "streaming-diloco", "dp.inner_steps": 10, "dp.fragments": 2,
                                     "dp.overlap": 1},
    "Streaming DiLoCo + PowerSGD r4": COMPRESSED_DP,
    "Streaming DiLoCo int8": {"dp.kind": "streaming-diloco", "dp.inner_steps": 10, "dp.fragments": 2,
                              "dp.overlap": 1, "dp.quantize": True},
    # Table 1 systems: Baseline (dense PP, exact DP), +DP (dense PP, compressed DP), M95+AP + compressed DP
    "+DP": COMPRESSED_DP,
    "M95 + compressed DP": {**COMPRESSED_DP, "boundary.kind": "mask", "boundary.p": 0.95},
    "M95+AP + compressed DP": {**COMPRESSED_DP, "boundary.kind": "mask", "boundary.p": 0.95, "mesh.anchor": 1,
                               "anchor.staleness": 20, "anchor.push_rank": 4, "optim.spectral.rank": 16},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="experiments/dp_compression/results")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    out = Path(args.out)
    results = {}
    arms = {k: v for k, v in ARMS.items() if not args.only or k in args.only.split(",")}
    for name, arm in arms.items():
        folder = out / name.replace(" ", "_").replace("+", "p")
        if (folder / "summary.json").is_file():
            results[name] = json.loads((folder / "summary.json").read_text())
            continue
        cfg = Config()
        apply_overrides(cfg, {**BASE, "train.steps": args.steps, "eval.every": max(1, args.steps // 8), **arm})
        t0 = time.time()
        results[name] = train(cfg.validate(), folder, progress=False)
        print(f"[done] {name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    ref = results.get("all-reduce")
    for name, s in results.items():
        b = s["bytes_per_token"]
        rows.append({"arm": name, "val_loss": s["final_val_loss"], "dp_bytes_per_token": b["dp"],
                     "dp_reduction": (ref["bytes_per_token"]["dp"] / b["dp"]) if ref and b["dp"] else None,
                     "pp_bytes_per_token": b["pp_fwd"] + b["pp_bwd"], "anchor_bytes_per_token": b["anchor"],
                     "total_bytes_per_token": sum(b.values())})
    lines = ["| arm | held-out loss | DP B/token | DP reduction | PP B/token | anchor B/token | total B/token |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        red = f"{r['dp_reduction']:.0f}x" if r["dp_reduction"] else "-"
        lines.append(f"| {r['arm']} | {r['val_loss']:.4f} | {r['dp_bytes_per_token']:.0f} | {red} | "
                     f"{r['pp_bytes_per_token']:.0f} | {r['anchor_bytes_per_token']:.0f} | "
                     f"{r['total_bytes_per_token']:.0f} |")
    table = "\n".join(lines)
    print(table)
    (out / "report.md").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps({"base": BASE, "steps": args.steps, "arms": ARMS, "rows": rows,
                                                 "val_points": {k: v["val_points"] for k, v in results.items()},
                                                 **code_stamp()},
                                                indent=2))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in results.items():
        ax.plot(*zip(*s["val_points"]), "o-", ms=3, label=name)
    ax.set(xlabel="step", ylabel="held-out loss", title=f"tiny-llama, 4 replicas x 2 stages, {args.steps} steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)


if __name__ == "__main__":
    main()
