"""``thinpipe top RUN``: where a job's time goes, per rank, live (issue 54).

Reads the run folder's ``ranks.jsonl`` (``engine/rank_rows.py``: one row per rank per step, written by the job's
lead as each step ends) and shows, for the newest step and as a mean over the run so far, each rank's compute
seconds, its seconds waiting on each pipeline neighbour and the Mbit/s each link it sends on achieved, and names the
slowest rank and the slowest link. For a running job the table is redrawn at every new step until the job writes its
``summary.json`` (Ctrl-C leaves); for a finished run it is printed once. A dist job across machines: the folder of
the machine that holds rank 0's ``--out`` (``train.model_rank``'s machine writes the model; the rows are the lead's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from thinpipe.config import ConfigError
from thinpipe.engine.rank_rows import RANKS_FILE, slowest
from thinpipe.jsonl import read_rows

NAME = "top"
HELP = "where a job's time goes per rank: compute, waits on neighbours, link Mbit/s (live while it runs)"


def table(rows: list[dict]) -> str:
    """The newest step's row per rank beside its mean over the run; the slowest rank and link named."""
    if not rows:
        return "no steps yet"
    last = max(r["step"] for r in rows)
    mean: dict[int, dict] = {}
    for r in rows:
        m = mean.setdefault(r["rank"], {"n": 0, "compute_s": 0.0, "wait_s": 0.0})
        m["n"] += 1
        m["compute_s"] += r["compute_s"]
        m["wait_s"] += sum(r["wait_s"].values())
    who = slowest(rows)
    head = (f"{'rank':>4} {'rep':>3} {'stage':>5} {'compute s':>10} {'mean':>8} {'wait s (neighbour: s)':<28} "
            f"{'send Mbit/s (boundary: rate)':<30}")
    lines = [f"step {last + 1} ({len({r['step'] for r in rows})} steps recorded)", head, "-" * len(head)]
    for r in sorted((r for r in rows if r["step"] == last), key=lambda r: r["rank"]):
        m = mean[r["rank"]]
        waits = ", ".join(f"{k}: {v:.3f}" for k, v in r["wait_s"].items()) or "-"
        links = ", ".join(f"{k}: {'-' if v is None else f'{v:.1f}'}" for k, v in r["send_mbps"].items()) or "-"
        mark = "  <- slowest" if r["rank"] == who["slowest_rank"] else ""
        lines.append(f"{r['rank']:>4} {r['replica']:>3} {r['stage']:>5} {r['compute_s']:>10.3f} "
                     f"{m['compute_s'] / m['n']:>8.3f} {waits:<28} {links:<30}{mark}")
    link = who["slowest_link"]
    lines.append(f"slowest rank: {who['slowest_rank']} (most compute over the run); slowest link: "
                 + ("none timed (unshaped links are not timed)" if link is None else
                    f"boundary {link} (between stages {link} and {link + 1}: fewest Mbit/s)"))
    return "\n".join(lines)


def add_arguments(tp: argparse.ArgumentParser) -> None:
    tp.add_argument("run", metavar="RUN", help="a run folder (--out of `thinpipe train` / `thinpipe launch`)")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between looks at a running job (default 1)")
    tp.add_argument("--once", action="store_true", help="print the table once and exit, even while the job runs")


def run(args) -> int:
    folder = Path(args.run)
    if not folder.is_dir():
        raise ConfigError(f"thinpipe top: {folder} is not a run folder (give the --out of a training run)")
    if args.interval <= 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {args.interval}")
    path = folder / RANKS_FILE
    finished = (folder / "summary.json").is_file()
    if not path.is_file() and (finished or not (folder / "config.toml").is_file()):
        raise ConfigError(f"thinpipe top: {folder} has no {RANKS_FILE} (a run from before issue 54, or not a run "
                          "folder): train it again to see where its time goes")
    if finished or args.once:
        print(table(read_rows(path, None) if path.is_file() else []))
        return 0
    shown, live = -1, sys.stdout.isatty()
    try:
        while True:
            rows = read_rows(path, None) if path.is_file() else []
            done = (folder / "summary.json").is_file()
            newest = max((r["step"] for r in rows), default=-1)
            if newest != shown or done:
                shown = newest
                if live:
                    print("\033[2J\033[H", end="")  # clear the terminal: the table in place
                print(table(rows), flush=True)
            if done:
                summary = json.loads((folder / "summary.json").read_text())
                print(f"finished: slowest rank {summary.get('slowest_rank')}, slowest link "
                      f"{summary.get('slowest_link')}")
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
