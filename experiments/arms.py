"""Shared runner for experiment suites: each arm is one `thinpipe train` process.

An arm is a name and its `--set` overrides on top of the suite's recipe. Finished arms (a
`summary.json` in their folder) are skipped, so a suite can be rerun after an interruption and
only the missing arms run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def arm_dir(out: Path, name: str, aliases: dict[str, str] | None = None) -> Path:
    name = (aliases or {}).get(name, name)
    return out / name.replace(" ", "_").replace("+", "p")


def run_arm(name: str, sets: dict, out: Path, base: dict, threads: int, aliases: dict[str, str] | None = None,
            folder: Path | None = None) -> dict:
    """One arm; a folder with a checkpoint (``train.checkpoint_every``) but no summary is resumed."""
    folder = folder or arm_dir(out, name, aliases)
    if aliases and name in aliases:
        print(f"[alias] {name} is the {aliases[name]} run", flush=True)
    if (folder / "summary.json").is_file():
        print(f"[skip] {name}: done already", flush=True)
        return json.loads((folder / "summary.json").read_text())
    resume = (folder / "checkpoint").is_dir()
    again = not resume and (folder / "config.toml").is_file()  # cut off before its first checkpoint: start over
    args = [sys.executable, "-m", "thinpipe", "train", "--out", str(folder), "--quiet"]
    args += ["--resume"] if resume else ["--overwrite"] if again else []
    for k, v in {**base, **sets}.items():
        args += ["--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.time()
    print(f"[{'resume' if resume else 'start'}] {name}", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "log.txt", "a" if resume else "w") as log:
        r = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        print(f"[fail] {name}: exit {r.returncode}, see {folder / 'log.txt'}", flush=True)
        return {}
    print(f"[done] {name} in {time.time() - t0:.0f} s", flush=True)
    return json.loads((folder / "summary.json").read_text())


def run_suite(arms: dict[str, dict], out: Path, base: dict, jobs: int, threads: int,
              aliases: dict[str, str] | None = None, folders: dict[str, Path] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda kv: run_arm(kv[0], kv[1], out, base, threads, aliases, (folders or {}).get(kv[0])),
                      arms.items()))


def select(arms: dict[str, dict], only: str, suite: str) -> dict[str, dict]:
    if not only:
        return arms
    keep = {a.strip() for a in only.split(",")}
    unknown = keep - set(arms)
    if unknown:
        raise SystemExit(f"--only names arms not in suite {suite!r}: {sorted(unknown)}; its arms are {sorted(arms)}")
    return {k: v for k, v in arms.items() if k in keep}


def load_results(folder: Path) -> dict | None:
    """An arm's summary.json with its per-step metrics.jsonl rows under "metrics" (None if unfinished)."""
    if not (folder / "summary.json").is_file():
        return None
    s = json.loads((folder / "summary.json").read_text())
    s["metrics"] = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return s


def save_figure(fig, axes, path: Path) -> None:
    """Grid + legend on every axis, tight layout, PNG, close."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
