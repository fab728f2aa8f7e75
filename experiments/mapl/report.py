"""Tables (markdown + JSON) and plots from the runs `run.py` wrote.

    .venv/bin/python experiments/mapl/report.py --out experiments/mapl/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

from thinpipe.provenance import code_stamp

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import arm_dir, load_results, save_figure  # noqa: E402
from run import ALIASES, SUITES  # noqa: E402

# Table 1's reference for each suite (its own model, P and recipe).
REFERENCE = {"main": "Uncompressed", "table5": "Uncompressed", "table6": "Uncompressed", "p8": "Uncompressed P8",
             "150m": "Uncompressed 150M"}
EXTRA = {"table5": ["spel r32"], "table6": ["anchor factorized r32"]}
# The adaptation suite uses the anchor-priors recipe exactly: its Dense and masking arms are the
# comparison at equal PP bytes (M95: 29 values per token and direction; MAPL r = 28 + token ids).
ANCHOR = Path(__file__).resolve().parents[1] / "anchor_priors" / "results"
EXTERNAL = {"adapt": {"Dense (anchor_priors)": ANCHOR / "Dense", "M95 (anchor_priors)": ANCHOR / "M95",
                      "M95+AP (anchor_priors)": ANCHOR / "M95pAP",
                      "M95 norescale (anchor_priors)": ANCHOR / "M95_norescale"}}
REFERENCE["adapt"] = "Dense (anchor_priors)"


def pp_bpt(s: dict, params: bool = True) -> float:
    b = s["bytes_per_token"]
    return b["pp_fwd"] + b["pp_bwd"] + (b.get("pp_params", 0.0) if params else 0.0)


def table(results: dict[str, dict], ref: dict | None) -> str:
    head = ("| arm | held-out loss | Δ% vs uncompressed | PP B/token (activations) | compression | "
            "+ projector sync B/token | captured energy (learned / fixed random) | wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in results.items():
        rel = (s["final_val_loss"] / ref["final_val_loss"] - 1) * 100 if ref else None
        comp = pp_bpt(ref, False) / pp_bpt(s, False) if ref else None
        energy = [m["captured_energy"] for m in s["metrics"] if "captured_energy" in m]
        en = "-"
        if energy:
            last = energy[-1]
            en = (f"{sum(last['learned']) / len(last['learned']):.3f} / "
                  f"{sum(last['fixed']) / len(last['fixed']):.3f}")
        lines.append(f"| {name} | {s['final_val_loss']:.4f} | {'-' if rel is None else f'{rel:+.2f}'}% | "
                     f"{pp_bpt(s, False):.0f} | {'-' if comp is None else f'{comp:.1f}x'} | "
                     f"{s['bytes_per_token'].get('pp_params', 0.0):.0f} | {en} | {s['wall_s']:.0f} |")
    return "\n".join(lines)


def plot(name: str, results: dict[str, dict], path: Path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, s in results.items():
        steps, losses = zip(*s["val_points"])
        ax[0].plot(steps, losses, "o-", ms=3, label=arm)
        energy = [(m["step"] + 1, m["captured_energy"]) for m in s["metrics"] if "captured_energy" in m]
        if energy:
            xs = [e[0] for e in energy]
            line, = ax[1].plot(xs, [sum(e["learned"]) / len(e["learned"]) for _, e in energy], "-", label=f"{arm}")
            ax[1].plot(xs, [sum(e["fixed"]) / len(e["fixed"]) for _, e in energy], ":", color=line.get_color())
    ax[0].set(xlabel="step", ylabel="held-out loss", title=f"{name}: held-out loss")
    ax[1].set(xlabel="step", ylabel="||X A||² / ||X||² (mean over boundaries)",
              title="captured energy: learned (solid) vs fixed random (dotted)", ylim=(0, 1.05))
    save_figure(fig, ax, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/mapl/results")
    args = ap.parse_args()
    out = Path(args.out)
    report, md = {}, []
    for suite, arms in SUITES.items():
        names = list(arms) + EXTRA.get(suite, [])
        external = {a: r for a, folder in EXTERNAL.get(suite, {}).items() if (r := load_results(folder)) is not None}
        ref_name = REFERENCE.get(suite)
        ref = external.get(ref_name) or (load_results(arm_dir(out, ref_name, ALIASES)) if ref_name else None)
        results = {**external, **{a: r for a in names if (r := load_results(arm_dir(out, a, ALIASES))) is not None}}
        if ref is not None and ref_name not in results:
            results = {ref_name: ref, **results}
        if not results:
            continue
        md += [f"### {suite}", "", table(results, ref), ""]
        plot(suite, results, out / f"{suite}.png")
        report[suite] = {a: {k: v for k, v in s.items() if k != "metrics"} for a, s in results.items()}
    (out / "report.md").write_text("\n".join(md))
    (out / "report.json").write_text(json.dumps({**report, **code_stamp()}, indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    main()
