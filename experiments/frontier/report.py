"""The frontier table (issue 17): every arm of the anchor-priors recipe, held-out loss against PP bytes.

Arms: this suite's runs (experiments/frontier/results, today's code) and the committed runs of the
same recipe in experiments/anchor_priors/results (older code; this suite's Dense rerun is the
control that they are comparable: the difference is printed). Writes results/frontier.json (a list
of arms with arm, kind, pp_bytes_per_token, best_val_loss, final_val_loss, seed, ...),
results/frontier.md and results/frontier.png.

    .venv/bin/python experiments/frontier/report.py
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [(HERE / "results", "frontier"), (HERE.parent / "anchor_priors" / "results", "anchor_priors (committed)"),
           (HERE.parent / "mapl" / "results", "mapl adapt (committed)")]
# the committed arms of this recipe (experiments/anchor_priors BASE; experiments/mapl --suite adapt)
OLD_ARMS = {"Dense", "M90", "M95", "TopK95", "M90pAP", "M95pAP", "M95_norescale", "TopK95pAP", "M99pAP_d20",
            "MAPL_r28_pca", "MAPL_r28_random"}
DENSE_PP = 13824.0  # fp32, 4 stages, H = 576: 3 boundaries x 576 x 4 B, each way
GOAL_X, MILESTONE_X, WITHIN = 20.0, 10.0, 0.01


def arm_row(folder: Path, source: str) -> dict | None:
    if not (folder / "summary.json").is_file():
        return None
    s = json.loads((folder / "summary.json").read_text())
    cfg = tomllib.loads((folder / "config.toml").read_text())
    b = cfg["boundary"]
    vals = s["val_points"]
    best_step, best = min(vals, key=lambda v: v[1])
    pp = s["bytes_per_token"]["pp_fwd"] + s["bytes_per_token"]["pp_bwd"]
    return {"arm": folder.name.replace("_", " ").replace("pAP", "+AP"), "source": source, "kind": b["kind"],
            "p": b.get("p") if b["kind"] in ("mask", "topk", "bottleneck") else None,
            "fwd_bits": b.get("fwd_bits"), "bwd_bits": b.get("bwd_bits"),
            "outlier_channels": b.get("outlier_channels") if b["kind"] == "outlier" else None,
            "anchor": cfg["mesh"].get("anchor", 0), "seed": cfg["train"]["seed"],
            "pp_fwd_bytes_per_token": s["bytes_per_token"]["pp_fwd"],
            "pp_bwd_bytes_per_token": s["bytes_per_token"]["pp_bwd"], "pp_bytes_per_token": pp,
            "compression_x": DENSE_PP / pp, "pp_bytes_per_token_bf16": bf16_bytes(b, pp),
            "compression_x_bf16": DENSE_PP / 2 / bf16_bytes(b, pp),
            "initial_val_loss": vals[0][1], "best_val_loss": best, "best_step": best_step,
            "final_val_loss": s["final_val_loss"], "val_points": vals, "wall_s": s["wall_s"], "steps": s["steps"]}


def bf16_bytes(b: dict, pp: float) -> float:
    """The same arm's PP bytes per token on a bf16 wire: values halve; codes and their bf16 scales do not;
    the outlier kind's intact channels (forward, 3 boundaries) halve unless they are bf16 already."""
    if b["kind"] in ("identity", "mask", "topk", "bottleneck"):
        return pp / 2
    if b["kind"] in ("mapl", "ssn"):  # r values each way halve; token ids and codes do not
        return pp - b["rank"] * 2 * 2 * 3
    if b["kind"] == "outlier" and b.get("outlier_dtype", "wire") == "wire":
        return pp - b["outlier_channels"] * 2 * 3
    return pp


def collect() -> list[dict]:
    rows = []
    for root, source in SOURCES:
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if source != "frontier" and folder.name not in OLD_ARMS:
                continue
            row = arm_row(folder, source)
            if row is not None:
                rows.append(row)
    return rows


def main() -> None:
    rows = collect()
    dense = next(r for r in rows if r["kind"] == "identity" and r["seed"] == 0 and r["source"] == "frontier")
    old_dense = next((r for r in rows if r["kind"] == "identity" and r["source"].startswith("anchor_priors")), None)
    dense_of_seed = {r["seed"]: r for r in rows if r["kind"] == "identity" and r["source"] == "frontier"}
    for r in rows:
        own = dense_of_seed.get(r["seed"], dense) if r["source"] == "frontier" else dense
        r["final_vs_dense"] = r["final_val_loss"] / own["final_val_loss"] - 1
        r["best_vs_dense"] = r["best_val_loss"] / own["best_val_loss"] - 1
    seeds = seed_pairs(rows)  # adds final_vs_dense_mean to the seed-0 arms that have a seed-1 twin
    for r in rows:
        gap = r.get("final_vs_dense_mean", r["final_vs_dense"])  # both seeds when there are two
        r["meets_milestone"] = r["compression_x"] >= MILESTONE_X and gap <= WITHIN and r["seed"] == 0
        r["meets_goal"] = r["compression_x"] >= GOAL_X and gap <= WITHIN and r["seed"] == 0
    rows.sort(key=lambda r: (-r["pp_bytes_per_token"], r["arm"]))
    out = HERE / "results"
    (out / "frontier.json").write_text(json.dumps(rows, indent=2))
    lines = ["| arm | kind | source | seed | PP B/token (fwd / bwd) | x dense | x dense, bf16 wire | best held-out (step) "
             "| final held-out | final vs Dense | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['kind']} | {r['source']} | {r['seed']} | {r['pp_bytes_per_token']:,.0f} "
                     f"({r['pp_fwd_bytes_per_token']:,.0f} / {r['pp_bwd_bytes_per_token']:,.0f}) | "
                     f"{r['compression_x']:.1f}x | {r['compression_x_bf16']:.1f}x | {r['best_val_loss']:.4f} "
                     f"({r['best_step']}) | {r['final_val_loss']:.4f} | {r['final_vs_dense']:+.1%} | {r['wall_s']:.0f} |")
    lines += seeds
    if old_dense is not None:
        lines.append(f"\nControl: Dense rerun today {dense['final_val_loss']:.6f} vs committed "
                     f"{old_dense['final_val_loss']:.6f} ({dense['final_val_loss'] - old_dense['final_val_loss']:+.2e}).")
    best = [r for r in rows if r["kind"] != "identity" and r["seed"] == 0
            and r.get("final_vs_dense_mean", r["final_vs_dense"]) <= WITHIN]
    if best:
        top = max(best, key=lambda r: r["compression_x"])
        seeds_said = "mean of seeds 0 and 1" if "final_vs_dense_mean" in top else "seed 0 only"
        lines.append(f"Most compressed arm within {WITHIN:.0%} of Dense's final held-out loss ({seeds_said}): "
                     f"{top['arm']} at {top['compression_x']:.1f}x ({top['pp_bytes_per_token']:,.0f} B/token).")
    else:
        lines.append(f"No compressed arm is within {WITHIN:.0%} of Dense's final held-out loss (two-seed mean where "
                     "there are two seeds).")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, dense, out / "frontier.png")


def seed_pairs(rows: list[dict]) -> list[str]:
    """Arms run with seeds 0 and 1, each against the Dense run of its own seed: a seed draws the data
    order and also which MATH-500 rows pack into the held-out rows (data.val_rows), so losses of
    different seeds are not comparable with each other, only their gaps to their own Dense are."""
    fr = {r["arm"]: r for r in rows if r["source"] == "frontier"}
    if "Dense seed 1" not in fr:
        return []
    d0, d1 = fr["Dense"]["final_val_loss"], fr["Dense seed 1"]["final_val_loss"]
    out = [f"\nTwo seeds (each against its own seed's Dense: {d0:.4f} / {d1:.4f}; the held-out rows differ by seed):"]
    for name, r in fr.items():
        twin = fr.get(f"{name} seed 1")
        if twin is None or r["kind"] == "identity":
            continue
        g0, g1 = r["final_val_loss"] / d0 - 1, twin["final_val_loss"] / d1 - 1
        out.append(f"{name} at {r['compression_x']:.1f}x: seed 0 {g0:+.2%}, seed 1 {g1:+.2%}, mean {(g0 + g1) / 2:+.2%}.")
        r["final_vs_dense_seed1"], r["final_vs_dense_mean"] = g1, (g0 + g1) / 2
    return out


def plot(rows: list[dict], dense: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in rows:
        marker = "s" if r["source"] == "frontier" else "o"
        ax.scatter(r["pp_bytes_per_token"], r["final_val_loss"], marker=marker)
        ax.annotate(r["arm"], (r["pp_bytes_per_token"], r["final_val_loss"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.axhline(dense["final_val_loss"] * (1 + WITHIN), color="g", ls=":", lw=0.8, label="Dense + 1%")
    ax.axhline(dense["initial_val_loss"], color="k", ls="--", lw=0.8, label="before training")
    ax.axvline(DENSE_PP / GOAL_X, color="r", ls=":", lw=0.8, label="goal: 1/20 of Dense's bytes")
    ax.set_xscale("log")
    ax.set_xlabel("PP bytes per token (fp32 wire, forward + backward, 3 boundaries)")
    ax.set_ylabel("final held-out loss (nats/token)")
    ax.set_title("SmolLM2-135M, 4 stages, MATH, 100 steps (squares: this suite; circles: committed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
