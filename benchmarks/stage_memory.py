"""Peak memory of each rank of a distributed job: a 1-stage job vs a 4-stage job, before and after
each rank loads only its own stage (docs/memory.md).

"before": every rank loads the whole model and carves it (``THINPIPE_BENCH_WHOLE_MODEL=1``, the
path ``rank/from_config.py: load_stage(whole=True)`` keeps for this measurement); "after": every rank
builds only its stage and reads only its tensors (``models/stage_loading.py``). SmolLM2-135M,
``model.tied=untie``, one training step of one 64-token row. Each rank runs this file's ``rank``
entry under torchrun: it trains (``thinpipe train --engine dist``) and then writes its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``) to ``OUT/peak_rss/rank{r}.json``. Writes
``benchmarks/results/stage_memory.json`` and prints the table that ``docs/memory.md`` shows.

    .venv/bin/python benchmarks/stage_memory.py [--stages 1 4] [--arms before after]

The scale presets (issue 38: ``llama-150m`` / ``llama-500m`` / ``llama-1b``) with LoRA, "after" only (their
"before" would hold the whole model on every rank), into their own results file:

    .venv/bin/python benchmarks/stage_memory.py --model llama-1b --set train.lora.rank=16 --arms after \
        --results benchmarks/results/scale_memory_llama-1b_lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "stage_memory.json"
SETTINGS = ["model.name=smollm2-135m", "model.tied=untie", "data.name=synthetic", "data.val_rows=1",
            "train.batch_size=1", "train.seq_len=64", "train.microbatches=1", "train.steps=1",
            "train.checkpoint_every=0"]
ARMS = {"before": "1", "after": "0"}  # THINPIPE_BENCH_WHOLE_MODEL


def rank_entry(argv: list[str]) -> int:
    """One rank (started by torchrun): train, then record this process's peak resident set."""
    from thinpipe.cli import main

    code = main([*argv, "--engine", "dist"])
    out = Path(argv[argv.index("--out") + 1])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    rank = int(os.environ["RANK"])
    folder = out / "peak_rss"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_bytes": peak}))
    print(f"[stage_memory rank {rank}] peak_rss_bytes {peak}", file=sys.stderr)
    return code


def run_job(stages: int, arm: str, work: Path, settings: list[str] = SETTINGS) -> list[int]:
    """A dist job of ``stages`` ranks (one replica); each rank's peak RSS in bytes, by rank (= stage)."""
    from thinpipe.comm.jobkey import KEY_ENV, write_key_file

    out = work / f"{arm}-pp{stages}"
    key = write_key_file(work / f"{arm}-pp{stages}.key")  # the job key every rank needs (docs/security.md)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THINPIPE_BENCH_WHOLE_MODEL": ARMS[arm], KEY_ENV: str(key),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    sets = [x for s in [*settings, f"mesh.pp={stages}"] for x in ("--set", s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
           str(Path(__file__).resolve()), "rank", "train", "--out", str(out), "--quiet", *sets]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{arm}, {stages} stages failed:\n{r.stderr[-3000:]}")
    run_job.step_s[(arm, stages)] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["wall_s"]
    return [json.loads((out / "peak_rss" / f"rank{i}.json").read_text())["peak_rss_bytes"] for i in range(stages)]


run_job.step_s = {}  # (arm, stages) -> the training loop's seconds for its one step


def table(results: dict) -> str:
    """Markdown: peak RSS (MiB) per rank of each job, and the largest rank relative to the 1-stage job."""
    rows = ["| arm | stages | peak RSS per rank (MiB) | largest rank (MiB) | largest / 1-stage job |",
            "|---|---|---|---|---|"]
    for arm, jobs in results.items():
        one = max(jobs["1"]) if "1" in jobs else None
        for stages, peaks in jobs.items():
            ratio = f"{max(peaks) / one:.2f}" if one else "-"
            rows.append(f"| {arm} | {stages} | {', '.join(f'{p / 2**20:.0f}' for p in peaks)} | "
                        f"{max(peaks) / 2**20:.0f} | {ratio} |")
    return "\n".join(rows)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        return rank_entry(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 4])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--model", default="smollm2-135m", help="model.name (default SmolLM2-135M, untied)")
    p.add_argument("--set", action="append", default=[], help="more KEY=VALUE settings (e.g. train.lora.rank=16)")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    settings = [s for s in SETTINGS if not s.startswith("model.name=")] + [f"model.name={args.model}", *args.set]
    if args.model != "smollm2-135m":
        settings.remove("model.tied=untie")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="stage-memory-") as work:
        for arm in args.arms:
            for stages in args.stages:
                peaks = run_job(stages, arm, Path(work), settings)
                results.setdefault(arm, {})[str(stages)] = peaks
                print(f"{arm}, {stages} stages: peak RSS per rank (MiB) "
                      f"{[round(p / 2**20) for p in peaks]}", flush=True)
    print(table(results))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"settings": settings, "unit": "bytes (ru_maxrss x 1024)", **code_stamp(),
                                        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                                        "peak_rss_bytes": results,
                                        "step_s": {f"{a}-pp{n}": v for (a, n), v in run_job.step_s.items()}},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
