"""What starting the ranks costs: the same small ``thinpipe launch`` job (tiny-llama, 4 steps) with each rank a fresh
``python -m thinpipe`` (``--start-method spawn``, the way before issue 49) and forked from one warm server
(``--start-method forkserver``, the default), alternating, ``--repeats`` times each, for 2, 4 and 6 ranks. Wall
seconds of the whole launch (start to exit), their ratio, and whether the two jobs' losses are bitwise equal.
Run it with nothing else on the machine.

    .venv/bin/python benchmarks/launch_start.py            # -> benchmarks/results/launch_start.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.name=tiny-llama", "data.name=synthetic", "train.steps=4", "train.batch_size=2", "train.seq_len=32",
        "train.microbatches=2", "train.checkpoint_every=0", "eval.every=0"]
MESHES = {2: ["mesh.pp=2"], 4: ["mesh.pp=2", "mesh.dp=2"], 6: ["mesh.pp=3", "mesh.dp=2"]}


def job(nproc: int, method: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        sets = [x for s in [*BASE, *MESHES[nproc]] for x in ("--set", s)]
        cmd = [sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--start-method", method, "--",
               "train", "--out", f"{d}/o", "--quiet", *sets]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(f"the {method} job of {nproc} ranks failed:\n{p.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(f"{d}/o/metrics.jsonl").read_text().splitlines()]
        return {"wall_s": wall, "losses": [r["loss"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch_start.json"))
    args = ap.parse_args()
    rows = []
    print("| ranks | spawn s | forkserver s | forkserver / spawn | losses equal |\n|---|---|---|---|---|", flush=True)
    for nproc in MESHES:
        runs: dict[str, list] = {"spawn": [], "forkserver": []}
        for _ in range(args.repeats):
            for method in runs:
                runs[method].append(job(nproc, method))
        spawn, fork = (statistics.median(r["wall_s"] for r in runs[m]) for m in ("spawn", "forkserver"))
        equal = all(a["losses"] == b["losses"] for a, b in zip(runs["spawn"], runs["forkserver"]))
        rows.append({"ranks": nproc, "spawn_s": [round(r["wall_s"], 2) for r in runs["spawn"]],
                     "forkserver_s": [round(r["wall_s"], 2) for r in runs["forkserver"]],
                     "spawn_median_s": round(spawn, 2), "forkserver_median_s": round(fork, 2),
                     "ratio": round(fork / spawn, 3), "losses_equal": equal})
        print(f"| {nproc} | {spawn:.2f} | {fork:.2f} | {fork / spawn:.3f} | {equal} |", flush=True)
    out = {**code_stamp(), "cores": os.cpu_count(), "settings": BASE, "meshes": MESHES, "repeats": args.repeats,
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
