"""Tables (markdown + JSON) and plots from the runs `run.py` wrote.

    .venv/bin/python experiments/anchor_priors/report.py --out experiments/anchor_priors/results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

from thinpipe.provenance import code_stamp

matplotlib.use("Agg")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: arms.py
import matplotlib.pyplot as plt  # noqa: E402
from arms import save_figure  # noqa: E402
from run import SUITES, arm_dir  # noqa: E402


def load_arm(folder: Path) -> dict | None:
    if not (folder / "summary.json").is_file():
        return None
    s = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    diags = [r["diag"] for r in rows if "diag" in r]
    with_basis = [d for d in diags if "cos_blend_clean" in d]

    def mean(key, ds):
        vals = [d[key] for d in ds if key in d and not math.isnan(d[key])]
        return sum(vals) / len(vals) if vals else None

    s["diag_cos_mask_clean"] = mean("cos_mask_clean", with_basis or diags)
    s["diag_cos_blend_clean"] = mean("cos_blend_clean", with_basis)
    s["diag_filt_norm_ratio"] = mean("filt_norm_ratio", with_basis)
    s["diag_above_tau_mean"] = mean("above_tau_mean", with_basis)
    s["metrics"] = rows
    return s


def pp_bpt(s: dict) -> float:
    return s["bytes_per_token"]["pp_fwd"] + s["bytes_per_token"]["pp_bwd"]


def fmt(v, spec=".4f"):
    return "-" if v is None else format(v, spec)


def table(results: dict[str, dict], dense: dict | None) -> str:
    head = ("| arm | held-out loss | vs Dense | PP B/token | PP compression | anchor B/token | priors | "
            "cos(mask, clean) | cos(corrected, clean) | ‖filt‖/‖mask‖ | s_i > tau | wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in results.items():
        rel = (s["final_val_loss"] / dense["final_val_loss"] - 1) * 100 if dense else None
        comp = pp_bpt(dense) / pp_bpt(s) if dense else None
        lines.append(
            f"| {name} | {s['final_val_loss']:.4f} | {fmt(rel, '+.2f')}% | {pp_bpt(s):.0f} | {fmt(comp, '.1f')}x | "
            f"{s['bytes_per_token']['anchor']:.0f} | {s.get('priors_consumed', '-')} | "
            f"{fmt(s['diag_cos_mask_clean'], '.3f')} | {fmt(s['diag_cos_blend_clean'], '.3f')} | "
            f"{fmt(s['diag_filt_norm_ratio'], '.3f')} | {fmt(s['diag_above_tau_mean'], '.1f')} | {s['wall_s']:.0f} |")
    return "\n".join(lines)


def plot_suite(name: str, results: dict[str, dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, s in results.items():
        steps, losses = zip(*s["val_points"])
        axes[0].plot(steps, losses, "o-", ms=3, label=arm)
        d = [(r["step"], r["diag"]) for r in s["metrics"] if "diag" in r]
        if d:
            axes[1].plot([x for x, _ in d], [v["cos_mask_clean"] for _, v in d], "--", label=f"{arm}: masked")
            if any("cos_blend_clean" in v for _, v in d):
                axes[1].plot([x for x, v in d if "cos_blend_clean" in v],
                             [v["cos_blend_clean"] for _, v in d if "cos_blend_clean" in v], "-",
                             label=f"{arm}: corrected")
    axes[0].set(xlabel="step", ylabel="held-out loss (unmasked)", title=f"{name}: held-out loss")
    axes[1].set(xlabel="step", ylabel="cosine with clean gradient", title=f"{name}: gradient alignment")
    save_figure(fig, axes, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/anchor_priors/results")
    args = ap.parse_args()
    out = Path(args.out)
    dense = load_arm(arm_dir(out, "Dense"))
    report, md = {}, []
    for suite, arms in SUITES.items():
        if suite == "smoke":
            continue
        results = {a: r for a in arms if (r := load_arm(arm_dir(out, a))) is not None}
        if not results:
            continue
        # Each suite is compared with the Dense run of its own domain.
        ref = results.get("med Dense") if suite == "medical" else dense
        if suite not in ("main", "medical") and dense is not None:
            results = {"Dense": dense, **results}
        md += [f"### {suite}", "", table(results, ref), ""]
        plot_suite(suite, results, out / f"{suite}.png")
        report[suite] = {a: {k: v for k, v in s.items() if k != "metrics"} for a, s in results.items()}
    (out / "report.md").write_text("\n".join(md))
    (out / "report.json").write_text(json.dumps({**report, **code_stamp()}, indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    main()
