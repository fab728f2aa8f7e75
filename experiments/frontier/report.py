"""The frontier table (README.md): held-out loss against PP bytes, both accountings, paired seeds.

Runs: this suite's (experiments/frontier/results, one folder per arm x seed x steps; run.py) and the
committed runs of the same recipe in experiments/anchor_priors and experiments/mapl (older code,
seed 0). Writes results/frontier.json (one row per (arm, seed, steps): ``arm``, ``kind``, ``seed``,
``steps``, ``pp_bytes_per_token`` (fp32 wire, metered), ``pp_bytes_per_token_bf16``,
``best_val_loss``, ``final_val_loss``, ``split``, ``gap``, ``learning_ratio`` ...), results/frontier.md and
results/frontier.png.

Learning ratio (issue 52; ``thinpipe/analysis/learning.py``): the first step, linearly interpolated between held-out
evaluations, at which Dense of the same seed and length reaches the arm's final held-out loss, over the arm's
steps; null where Dense never gets there (the arm ends at or below Dense). A setting's is the mean over its seeds
(null if any seed's is).

Accounting: ``pp_bytes_per_token`` is what the meter counted on the fp32 wire these CPU runs used;
``pp_bytes_per_token_bf16`` is the same setting's payload on a bf16 wire (what a GPU run with
``train.dtype = auto`` sends), from the boundary's own byte formula at 2 B per value (tests check
the formula against the meter on both wires): values halve, codes and their bf16 scales do not. The
headline ratio is against the bf16 Dense wire (6,912 B/token); fp32 figures are the second column.

Statistics: the held-out rows do not depend on ``train.seed`` (thinpipe/data/loader.py), so a run's gap is its final
held-out loss over Dense's of the same seed and steps, minus 1; "within 1%" means the mean paired gap
over seeds 0, 1, 2 is <= +1.0% and no seed's is above +1.5%. Runs made before the split was fixed
(results/old_split) are listed with ``split = "old"`` and enter no verdict; seed-0 runs were on the
same rows before and after the fix (the fixed split is seed 0's).

    .venv/bin/python experiments/frontier/report.py
"""

from __future__ import annotations

import json
import statistics
import tomllib
from pathlib import Path

import torch

from thinpipe.analysis import learning_ratio
from thinpipe.boundary import build_boundaries
from thinpipe.config import Config, apply_overrides
from thinpipe.config.aliases import flat_aliases
from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent
SOURCES = [(HERE / "results", "frontier"), (HERE / "results" / "old_split", "frontier, old split"),
           (HERE.parent / "anchor_priors" / "results", "anchor_priors (committed)"),
           (HERE.parent / "mapl" / "results", "mapl adapt (committed)")]
# the committed arms of this recipe (experiments/anchor_priors BASE; experiments/mapl --suite adapt)
OLD_ARMS = {"Dense", "M90", "M95", "TopK95", "M90pAP", "M95pAP", "M95_norescale", "TopK95pAP", "M99pAP_d20",
            "MAPL_r28_pca", "MAPL_r28_random"}
HIDDEN, BOUNDARIES, MICROBATCH_TOKENS = 576, 3, 256  # SmolLM2-135M, 4 stages, 2 x 128 tokens per microbatch
DENSE_BF16 = HIDDEN * 2 * 2 * BOUNDARIES          # 6,912 B/token
GOAL_B, MILESTONE_B = 345, 691  # goal / milestone: 1/20 and 1/10 of the bf16 Dense wire (345.6, 691.2), rounded down
WITHIN, WORST_SEED, SEEDS = 0.01, 0.015, (0, 1, 2)
SETTING_KEYS = ("p", "fwd_bits", "bwd_bits", "outlier_channels", "outlier_grid", "outlier_bwd_tokens",
                "outlier_fwd_bits", "compress", "rank", "klt_bits", "klt_context_bits", "klt_bwd_tokens",
                "klt_channels", "klt_scale", "klt_refresh_every")


def boundary_keys(cfg: dict) -> dict:
    """A run folder's ``[boundary]`` under the flat keys of before issue 49: its kind's table (``[boundary.klt]
    bits``, what a run of since then records) as the table's flat aliases (``klt_bits``)."""
    flat = {new: old.removeprefix("boundary.") for old, new in flat_aliases().items()}
    out = {k: v for k, v in cfg["boundary"].items() if not isinstance(v, dict)}
    for kind, table in cfg["boundary"].items():
        if isinstance(table, dict):
            out.update({flat.get(f"boundary.{kind}.{k}", f"{kind}.{k}"): v for k, v in table.items()})
    return out


def bf16_bytes(cfg: dict, fp32_bytes: float) -> float:
    """The setting's PP bytes per token on a bf16 wire: the boundary's formula at 2 B per value. MAPL and
    SSN need the model to build; their r values each way halve, their token ids and codes do not."""
    b = boundary_keys(cfg)
    if b["kind"] in ("mapl", "ssn"):
        return fp32_bytes - b["rank"] * 2 * 2 * BOUNDARIES
    if b["kind"] in ("klt", "klt-dither"):  # codes (fixed or entropy-coded), bf16 scales and channels: no wire dtype
        return fp32_bytes
    c = Config()
    skip = ("dtype", "anchor")  # the wire is what this computes; "anchor" is an old name of MAPL's offset
    apply_overrides(c, {"mesh.pp": BOUNDARIES + 1, **{f"boundary.{k}": v for k, v in b.items() if k not in skip}},
                    source="report")
    fwd = bwd = 0
    for boundary in build_boundaries(c.validate().boundary, BOUNDARIES + 1, HIDDEN, 0, torch.bfloat16):
        f, g = boundary.expected_bytes(MICROBATCH_TOKENS, 2)
        fwd, bwd = fwd + f, bwd + g
    return (fwd + bwd) / MICROBATCH_TOKENS


def arm_name(folder: Path, cfg: dict) -> str:
    """The setting's name: the folder's, without its seed and steps (run.py: run_folder)."""
    name = folder.name.replace("_", " ").replace("pAP", "+AP")
    for tail in (f" steps {cfg['train']['steps']}", f" seed {cfg['train']['seed']}"):
        name = name.removesuffix(tail)
    return name


def arm_row(folder: Path, source: str) -> dict | None:
    if not (folder / "summary.json").is_file():
        return None
    s = json.loads((folder / "summary.json").read_text())
    cfg = tomllib.loads((folder / "config.toml").read_text())
    b = boundary_keys(cfg)
    vals = s["val_points"]
    best_step, best = min(vals, key=lambda v: v[1])
    # side information (a start's basis and tables, MAPL's projector sync): metered on pp_params, sent in its
    # own dtype whatever the wire, and counted in both columns
    side = s["bytes_per_token"].get("pp_params", 0.0)
    acts = s["bytes_per_token"]["pp_fwd"] + s["bytes_per_token"]["pp_bwd"]
    pp = acts + side
    committed = " (committed)" if source.endswith("(committed)") else ""
    return {"arm": arm_name(folder, cfg) + committed, "folder": str(folder.relative_to(HERE.parent.parent)),
            "source": source,
            "kind": b["kind"], "seed": cfg["train"]["seed"], "steps": s["steps"],
            "split": "old" if "old split" in source else "fixed",
            "settings": {k: v for k, v in b.items() if k in SETTING_KEYS},
            "anchor": cfg["mesh"].get("anchor", 0),
            "pp_fwd_bytes_per_token": s["bytes_per_token"]["pp_fwd"],
            "pp_bwd_bytes_per_token": s["bytes_per_token"]["pp_bwd"], "pp_side_bytes_per_token": side,
            "pp_bytes_per_token": pp, "pp_bytes_per_token_bf16": bf16_bytes(cfg, acts) + side,
            "initial_val_loss": vals[0][1], "best_val_loss": best, "best_step": best_step,
            "final_val_loss": s["final_val_loss"], "val_points": vals, "wall_s": s["wall_s"]}


def collect() -> list[dict]:
    rows = []
    for root, source in SOURCES:
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if source.endswith("(committed)") and folder.name not in OLD_ARMS:
                continue
            row = arm_row(folder, source)
            if row is not None:
                rows.append(row)
    return rows


def pair(rows: list[dict]) -> None:
    """Each run's gap against Dense of its own seed, steps and split (this suite's Dense first)."""
    dense = {}
    for r in sorted(rows, key=lambda r: r["source"] != "frontier"):
        if r["kind"] == "identity":
            dense.setdefault((r["seed"], r["steps"], r["split"]), r)
    for r in rows:
        d = dense.get((r["seed"], r["steps"], r["split"]))
        r["dense_final_val_loss"] = d["final_val_loss"] if d else None
        r["gap"] = r["final_val_loss"] / d["final_val_loss"] - 1 if d else None
        r["best_gap"] = r["best_val_loss"] / d["best_val_loss"] - 1 if d else None
        # the gap at every held-out point both runs have (does it shrink with training?)
        dense_at = dict((int(st), v) for st, v in d["val_points"]) if d else {}
        r["val_gaps"] = [[int(st), v / dense_at[int(st)] - 1] for st, v in r["val_points"] if int(st) in dense_at]
        # issue 52: the step Dense of this seed and length reaches the arm's final loss, over the arm's steps
        r["learning_ratio"] = learning_ratio(d["val_points"], r["final_val_loss"], r["steps"]) if d else None


def settings(rows: list[dict]) -> list[dict]:
    """One entry per (arm, steps) of the fixed split: its seeds' gaps, their mean, the verdict, and its
    bytes (a data-dependent codec's largest over the seeds)."""
    out = {}
    for r in rows:
        if r["split"] != "fixed" or r["gap"] is None:
            continue
        e = out.setdefault((r["arm"], r["steps"]), {"arm": r["arm"], "kind": r["kind"], "steps": r["steps"],
                                                     "source": r["source"], "gaps": {}, "losses": {},
                                                     "pp_bytes_per_token": 0.0,
                                                     "pp_bytes_per_token_bf16": 0.0})
        e["gaps"][r["seed"]] = r["gap"]
        e["losses"][r["seed"]] = r["final_val_loss"]
        e.setdefault("learning_ratios", {})[r["seed"]] = r["learning_ratio"]
        e["pp_bytes_per_token"] = max(e["pp_bytes_per_token"], r["pp_bytes_per_token"])
        e["pp_bytes_per_token_bf16"] = max(e["pp_bytes_per_token_bf16"], r["pp_bytes_per_token_bf16"])
    for e in out.values():
        gaps = list(e["gaps"].values())
        e["mean_gap"] = statistics.fmean(gaps)
        ratios = [x for x in e["learning_ratios"].values() if x is not None]  # None: at or below Dense
        e["learning_ratio"] = statistics.fmean(ratios) if ratios and len(ratios) == len(gaps) else None
        e["seeds"] = sorted(e["gaps"])
        e["three_seeds"] = all(s in e["gaps"] for s in SEEDS)
        e["within"] = e["three_seeds"] and e["mean_gap"] <= WITHIN and max(gaps) <= WORST_SEED
        e["x_bf16"] = DENSE_BF16 / e["pp_bytes_per_token_bf16"]
        e["x_fp32"] = 2 * DENSE_BF16 / e["pp_bytes_per_token"]
        e["meets_milestone"] = e["within"] and e["pp_bytes_per_token_bf16"] <= MILESTONE_B
        e["meets_goal"] = e["within"] and e["pp_bytes_per_token_bf16"] <= GOAL_B
    return sorted(out.values(), key=lambda e: (e["steps"], -e["pp_bytes_per_token_bf16"], e["arm"]))


def seed_cell(e: dict, s: int) -> str:
    """A seed's gap; Dense's own final held-out loss on its row."""
    if s not in e["gaps"]:
        return "-"
    return f"{e['losses'][s]:.4f}" if e["kind"] == "identity" else f"{e['gaps'][s]:+.2%}"


def table(entries: list[dict]) -> list[str]:
    lines = ["| arm | kind | steps | PP B/token, bf16 wire | x vs bf16 Dense | PP B/token, fp32 wire | x vs fp32 Dense "
             "| seed 0 | seed 1 | seed 2 | mean gap | learning ratio | within 1% (3 seeds) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        verdict = ("-" if e["kind"] == "identity" else ("**yes**" if e["within"] else "no") if e["three_seeds"]
                   else f"({len(e['seeds'])} seed{'s' if len(e['seeds']) > 1 else ''})")
        lines.append(f"| {e['arm']} | {e['kind']} | {e['steps']} | {e['pp_bytes_per_token_bf16']:,.0f} | "
                     f"{e['x_bf16']:.1f}x | {e['pp_bytes_per_token']:,.0f} | {e['x_fp32']:.1f}x | "
                     + " | ".join(seed_cell(e, s) for s in SEEDS)
                     + f" | {'-' if e['kind'] == 'identity' else format(e['mean_gap'], '+.2%')} | "
                     f"{'-' if e['learning_ratio'] is None else format(e['learning_ratio'], '.2f')} | {verdict} |")
    return lines


def verdicts(entries: list[dict]) -> list[str]:
    ok = [e for e in entries if e["within"] and e["kind"] != "identity"]
    lines = [f"\nWithin 1% = mean paired gap over seeds 0-2 <= +{WITHIN:.1%} and no seed above +{WORST_SEED:.1%}; "
             f"goal <= {GOAL_B:.0f} B/token and milestone <= {MILESTONE_B:.0f} B/token on the bf16 wire."]
    if not ok:
        return lines + ["No compressed setting is within 1% of Dense on three paired seeds."]
    top = min(ok, key=lambda e: e["pp_bytes_per_token_bf16"])
    lines.append(f"Fewest bytes within 1% on three paired seeds: {top['arm']} ({top['steps']} steps), "
                 f"{top['pp_bytes_per_token_bf16']:,.0f} B/token = {top['x_bf16']:.1f}x fewer than the bf16 Dense "
                 f"wire ({top['x_fp32']:.1f}x vs fp32), mean gap {top['mean_gap']:+.2%}. "
                 f"Milestone: {'met' if top['meets_milestone'] else 'not met'}; goal: "
                 f"{'met' if top['meets_goal'] else 'not met'}.")
    return lines


def main() -> None:
    rows = collect()
    pair(rows)
    entries = settings(rows)
    rows.sort(key=lambda r: (r["split"] != "fixed", r["steps"], -r["pp_bytes_per_token_bf16"], r["arm"], r["seed"]))
    out = HERE / "results"
    (out / "frontier.json").write_text(json.dumps([{**r, **code_stamp()} for r in rows], indent=2))
    (out / "frontier_settings.json").write_text(json.dumps(entries, indent=2))
    lines = table(entries) + verdicts(entries)
    old = [r for r in rows if r["split"] == "old"]
    if old:
        lines.append("\nBefore the held-out split was fixed (issue 17; each seed scored on other rows, so only its gap "
                     "to its own Dense is meaningful; in no verdict): "
                     + "; ".join(f"{r['arm']} seed {r['seed']} {r['gap']:+.2%}" for r in old if r["gap"] is not None)
                     + ".")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(entries, out / "frontier.png")


def plot(entries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for e in entries:
        if e["kind"] == "identity":
            continue
        marker = "s" if e["three_seeds"] else "o"
        ax.scatter(e["pp_bytes_per_token_bf16"], 100 * e["mean_gap"], marker=marker,
                   color="g" if e["within"] else "C0" if e["steps"] == 100 else "C1")
        ax.annotate(f"{e['arm']}" + (f" ({e['steps']} st)" if e["steps"] != 100 else ""),
                    (e["pp_bytes_per_token_bf16"], 100 * e["mean_gap"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.axhline(100 * WITHIN, color="g", ls=":", lw=0.8, label="Dense + 1%")
    ax.axvline(MILESTONE_B, color="orange", ls=":", lw=0.8, label="milestone: 1/10 of the bf16 Dense wire")
    ax.axvline(GOAL_B, color="r", ls=":", lw=0.8, label="goal: 1/20")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=5)
    ax.set_xlabel("PP bytes per token on a bf16 wire (forward + backward, 3 boundaries)")
    ax.set_ylabel("final held-out loss vs Dense, % (mean over seeds)")
    ax.set_title("SmolLM2-135M, 4 stages, MATH (squares: 3 paired seeds; green: within 1%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
