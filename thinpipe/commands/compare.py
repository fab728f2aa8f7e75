"""``thinpipe compare RUN [RUN ...]``: runs side by side, the quality-for-bytes picture users decide from.

One table (held-out loss at its best and at the end, bytes per token per axis, the wire dtype, PP
compression against the dense run among them, tokens/s) and, with ``--out``, ``compare.json`` and
``compare.png``: held-out loss against step and against the PP bytes sent so far (log scale).
A run still training is compared from its ``metrics.jsonl`` (marked "running"; its "vs dense" is
then at a different step than a finished run's).

Compression is stated against the Dense run's actual wire (issue 26): on a GPU ``train.dtype = auto``
trains in bf16 and Dense sends 2 B per value, so a quantiser's ratio (its codes do not shrink with the
wire) against an fp32 Dense is twice what a bf16 user gets; masking's is the same on both. The table
names that wire and its bytes, and says so when the runs crossed different wires.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

from thinpipe.config import ConfigError
from thinpipe.jsonl import read_rows
from thinpipe.runlock import check_out_path

NAME = "compare"
HELP = "runs side by side: held-out loss, bytes per token, compression, tokens/s"

AXES_SHOWN = ("pp_fwd", "pp_bwd", "dp", "anchor")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
MISTYPED = (KeyError, TypeError, ValueError, IndexError, OverflowError)  # a value missing or of the wrong type


def _rows(folder: Path) -> list[dict]:
    return read_rows(folder / "metrics.jsonl")  # a cut-off last line (a run killed mid-row): dropped, with a warning


def _read(path: Path, parse, fix: str):
    """``parse`` of a run file's text; a file that is not UTF-8 or does not parse is one line naming it."""
    try:
        return parse(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start + 1}): {fix}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests values thousands deep, which thinpipe never writes: {fix}") from None
    except ValueError as e:  # json's and tomllib's errors; a cut-off file ends in one
        raise ConfigError(f"{path} is cut off or not {'JSON' if parse is json.loads else 'TOML'} "
                          f"({_why(e)}): {fix}") from None


def _why(e: Exception) -> str:
    return f"no {e}" if isinstance(e, KeyError) else (str(e).splitlines() or [type(e).__name__])[0]


def wire_dtype(cfg: dict) -> str | None:
    """The dtype a run's PP values crossed in, from its config.toml as ``rank/from_config.py: wire_dtype``
    resolves it: ``boundary.dtype``, or with ``auto`` the training dtype the run folder records
    (resolved on the run's device); None where the folder leaves it unresolved (an older run)."""
    b, t = cfg.get("boundary"), cfg.get("train")
    name = b.get("dtype", "auto") if isinstance(b, dict) else "auto"
    if name == "auto":
        name = t.get("dtype", "auto") if isinstance(t, dict) else "auto"
    return name if name in SHORT else None


def _summary(s) -> tuple[list, int, dict, float | None, dict]:
    """(val points, tokens, bytes per token, tokens/s, bytes) of a summary.json; TypeError, KeyError or
    ValueError where a value is missing or of the wrong type (a hand-edited or foreign file)."""
    if not isinstance(s, dict):
        raise TypeError(f"a JSON {type(s).__name__}, not an object")
    points = [(int(p[0]), float(p[1])) for p in s["val_points"]]
    per_token = {str(k): float(v) for k, v in dict(s["bytes_per_token"]).items()}
    tps = None if s["tokens_per_s"] is None else float(s["tokens_per_s"])
    end = {int(s["steps"]): float(s.get("pp_fwd_bytes", 0)) + float(s.get("pp_bwd_bytes", 0))}
    return points, int(s["tokens"]), per_token, tps, end


def _running(rows: list[dict], measure: str = "val_loss") -> tuple[list, int, dict, float | None]:
    """(val points, tokens, bytes per token, tokens/s) of a run still training, from its metrics rows."""
    points = [(int(r["step"]) + 1, float(r[measure])) for r in rows if measure in r]
    last = rows[-1]
    tokens, wall = int(last["tokens"]), float(last["wall_s"])
    per_token = {k[:-6]: float(last[k]) / tokens if tokens else 0.0 for k in last if k.endswith("_bytes")}
    return points, tokens, per_token, tokens / wall if wall > 0 else None


def load(folder: str | Path) -> dict:
    """One run's comparable numbers (finished: summary.json; running: its metrics so far)."""
    folder = Path(folder)
    if not (folder / "config.toml").is_file():
        raise ConfigError(f"{folder} is not a thinpipe run folder (no config.toml): give --out folders of "
                          "`thinpipe train`")
    cfg = _read(folder / "config.toml", tomllib.loads, "restore the run's config.toml")
    objective = cfg.get("train", {}).get("objective", "sft") if isinstance(cfg.get("train"), dict) else "sft"
    from thinpipe.objective.registry import spec_named  # here: `thinpipe --help` imports no model library

    spec = spec_named(str(objective))  # its held-out measure: a loss (lower is better) or a score
    accuracy, measure = not spec.val_is_loss, spec.val_key
    b = cfg.get("boundary")
    kind = b.get("kind") if isinstance(b, dict) else None
    if not isinstance(kind, str):
        raise ConfigError(f"{folder / 'config.toml'} has no [boundary] kind = \"...\": restore the run's config.toml")
    rows = _rows(folder)
    done = (folder / "summary.json").is_file()
    try:
        by_step = {int(r["step"]) + 1: float(r.get("pp_fwd_bytes", 0)) + float(r.get("pp_bwd_bytes", 0)) for r in rows}
    except MISTYPED as e:
        raise ConfigError(f"{folder / 'metrics.jsonl'}: a row is not one thinpipe wrote ({_why(e)}): restore the "
                          "file") from None
    if done:
        s = _read(folder / "summary.json", json.loads, "delete it to compare the run from its metrics.jsonl, or "
                                                       "train it again")
        try:
            points, tokens, per_token, tps, end = _summary(s)
        except MISTYPED as e:
            raise ConfigError(f"{folder / 'summary.json'} is not a summary thinpipe wrote ({_why(e)}): delete it to "
                              "compare the run from its metrics.jsonl") from None
        by_step.update(end)
    else:
        if not rows:
            raise ConfigError(f"{folder} has no metrics yet (the run has not finished a step): compare it later")
        try:
            points, tokens, per_token, tps = _running(rows, measure)
        except MISTYPED as e:
            raise ConfigError(f"{folder / 'metrics.jsonl'}: a row is not one thinpipe wrote ({_why(e)}): restore the "
                              "file") from None
    if not points:
        raise ConfigError(f"{folder} has no held-out {'accuracy' if accuracy else 'loss'} yet: set eval.every, or "
                          "wait for it to finish")
    by_step[0] = 0
    best = max if accuracy else min
    return {"measure": measure, "higher_is_better": accuracy, "objective": objective,
        "run": folder.name, "path": str(folder), "finished": done, "kind": kind, "wire_dtype": wire_dtype(cfg),
        "dense": kind == "identity", "steps": max(p[0] for p in points), "tokens": tokens,
        # an objective's held-out measure (ObjectiveSpec.val_key): a loss, or a score such as GSPO's accuracy
        f"best_{measure}": best(p[1] for p in points), f"final_{measure}": points[-1][1],
        "bytes_per_token": {a: per_token.get(a, 0.0) for a in AXES_SHOWN},
        "pp_bytes_per_token": per_token.get("pp_fwd", 0.0) + per_token.get("pp_bwd", 0.0),
        "tokens_per_s": tps, "val_points": points,
        "val_vs_pp_bytes": [(by_step[st], v) for st, v in points if st in by_step],
    }


def compare(folders: list[str | Path]) -> dict:
    """The runs, each with ``pp_compression`` against the first dense run among them (None if none)."""
    if not folders:
        raise ConfigError("thinpipe compare needs at least one run folder")
    runs = [load(f) for f in folders]
    dense = next((r for r in runs if r["dense"]), None)
    for r in runs:  # no ratio where either sends no PP bytes (mesh.pp = 1)
        r["pp_compression"] = (dense["pp_bytes_per_token"] / r["pp_bytes_per_token"]
                               if dense and dense["pp_bytes_per_token"] and r["pp_bytes_per_token"] else None)
        r["vs_dense_final"] = _vs_dense(r, dense)
    return {"dense": dense["run"] if dense else None, "runs": runs,
            "dense_wire_dtype": dense["wire_dtype"] if dense else None,
            "dense_pp_bytes_per_token": dense["pp_bytes_per_token"] if dense else None,
            "accounting": accounting(dense, runs)}


def _vs_dense(r: dict, dense: dict | None) -> float | None:
    """A loss against Dense's as a ratio minus 1; an accuracy as a difference (both runs of one objective: a DPO
    loss is not an SFT loss)."""
    if dense is None or r["measure"] != dense["measure"] or r["objective"] != dense["objective"]:
        return None
    final = f"final_{r['measure']}"
    if r["higher_is_better"]:
        return r[final] - dense[final]
    return r[final] / dense[final] - 1 if dense[final] else None


def accounting(dense: dict | None, runs: list[dict]) -> list[str]:
    """The lines that say what the compression is against: Dense's wire and bytes, and whether the runs
    crossed different wires (a ratio or a loss across wires is not like-for-like)."""
    if dense is None:
        return ["compr. and vs dense: - (no dense run among these to compare against: train one with "
                "boundary.kind = identity)"]
    wire = SHORT.get(dense["wire_dtype"], "unrecorded")
    if not dense["pp_bytes_per_token"]:
        return [f"compr.: - (Dense, run {dense['run']}, sends no PP bytes: one stage)"]
    lines = [f"compr. = Dense's PP bytes / this run's, against Dense's {wire} wire "
             f"({dense['pp_bytes_per_token']:,.0f} B/token, run {dense['run']})"
             + (f"; against a bf16 wire (train.dtype = auto on a GPU: {dense['pp_bytes_per_token'] / 2:,.0f} B/token) "
                "a quantiser's ratio halves (its codes do not shrink), a mask's does not"
                if dense["wire_dtype"] == "float32" else "")]
    by_wire: dict[str, list[str]] = {}
    for r in runs:
        by_wire.setdefault(SHORT.get(r["wire_dtype"], "unrecorded"), []).append(r["run"])
    if len(by_wire) > 1:
        lines.append("these runs crossed different wires (" + "; ".join(f"{w}: {', '.join(n)}" for w, n in
                                                                       by_wire.items())
                     + "): a ratio or a loss across wires is not like-for-like; compare runs of one boundary.dtype "
                       "(auto: train.dtype)")
    return lines


def format_table(result: dict) -> str:
    head = (f"{'run':<22}{'kind':<10}{'best held-out':>14}{'final':>9}{'vs dense':>10}{'wire':>6}{'PP B/tok':>10}"
            f"{'compr.':>8}{'DP B/tok':>10}{'anchor B/tok':>13}{'tok/s':>8}")
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        acc = r["higher_is_better"]
        vs = ("-" if r["vs_dense_final"] is None or r["dense"] else
              f"{100 * r['vs_dense_final']:+.1f}pt" if acc else f"{r['vs_dense_final']:+.1%}")
        best_v, final_v = r[f"best_{r['measure']}"], r[f"final_{r['measure']}"]
        comp = "-" if r["pp_compression"] is None else f"{r['pp_compression']:.1f}x"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        name = r["run"] + ("" if r["finished"] else " (running)")
        wire = SHORT.get(r["wire_dtype"], "?")
        shown = f"{best_v:>10.1%} acc{final_v:>9.1%}" if acc else f"{best_v:>14.4f}{final_v:>9.4f}"
        lines.append(f"{name:<22}{r['kind']:<10}{shown}{vs:>10}"
                     f"{wire:>6}{r['pp_bytes_per_token']:>10.1f}{comp:>8}{r['bytes_per_token']['dp']:>10.1f}"
                     f"{r['bytes_per_token']['anchor']:>13.1f}{tps:>8}")
    lines.append("held-out loss (GSPO runs: greedy accuracy on held-out prompts, acc) is measured through dense "
                 "boundaries; PP B/tok = forward + backward boundary bytes per "
                 "trained token; wire = the dtype PP values cross in (boundary.dtype; auto: train.dtype)")
    return "\n".join(lines + result["accounting"])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in result["runs"]:
        label = f"{r['run']} ({r['pp_bytes_per_token']:.0f} PP B/token)"
        a.plot(*zip(*r["val_points"]), "o-", ms=3, label=label)
        pts = [(x, y) for x, y in r["val_vs_pp_bytes"] if x > 0]
        if pts:
            b.plot(*zip(*pts), "o-", ms=3, label=label)
    a.set_xlabel("step")
    b.set_xlabel("PP bytes sent (cumulative, log scale)")
    b.set_xscale("log")
    measures = {r["measure"] for r in result["runs"]}
    for ax in (a, b):
        ax.set_ylabel(f"held-out {measures.pop()}" if len(measures) == 1 else "held-out measure")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "compare.png")
    return out


def add_arguments(cp: argparse.ArgumentParser) -> None:
    cp.add_argument("runs", nargs="+", metavar="RUN", help="run folders (--out of `thinpipe train`)")
    cp.add_argument("--out", help="write compare.json and compare.png (held-out loss against step and PP bytes) here")
    cp.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args) -> int:
    if args.out:
        check_out_path(Path(args.out))
    result = compare(args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    if args.out:
        print(f"wrote {write(result, args.out)}/compare.json and compare.png")
    return 0
