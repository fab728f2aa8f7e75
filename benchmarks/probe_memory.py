"""Peak resident memory of ``thinpipe probe`` against the number of arms, before and after the probe
streams each arm's gradient cosines instead of storing the arm's gradients (docs/probe.md: memory).

Each measurement is a fresh child process that runs ``thinpipe.commands.probe_lib.probe`` on SmolLM2-135M
(4 stages, MATH, 2 held-out batches of 4 x 128 tokens, CPU, one torch thread) and then reads its own
peak resident set (``getrusage(RUSAGE_SELF).ru_maxrss`` and ``/proc/self/status: VmHWM``). "before"
is ``thinpipe/probe.py`` at ``--before-rev`` (the probe that kept every arm's per-batch gradients),
imported from a temporary file; "after" is the working tree's. Rows with 0 arms load the model and
the data and stop: the floor every probe pays. The children's arm results are compared: before and
after must give the same loss, cosines and bytes (``==``). Writes ``benchmarks/results/probe_memory.json``
and prints the table that ``docs/probe.md`` (Memory) shows.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_memory.py [--before 2 6] [--after 0 2 6 all]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "probe_memory.json"
# The probe as it was when it stored every batch's gradient of every arm (the last commit before it streamed them).
BEFORE_REV = "a2d65a17f18e2a8500565a9f637b6464b3aa122b"
SETTINGS = ["model.name=smollm2-135m", "mesh.pp=4", "data.name=math", "data.max_examples=100", "data.val_rows=32",
            "train.batch_size=4", "train.seq_len=128", "train.device=cpu"]
BATCHES = 2
# The arms of a run with N arms: the dense arm first, then these in order (the whole grid for "all").
ARMS = ["outlier 4b/2b", "mask p=0.9", "topk p=0.9", "quant4", "mapl r=32 pca"]


def _probe_module(code: str, rev: str, work: Path):
    if code == "after":
        import thinpipe.commands.probe_lib as module

        return module
    src = subprocess.run(["git", "show", f"{rev}:thinpipe/probe.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    path = work / "probe_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("probe_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            "vm_hwm_bytes": int(status["VmHWM"].split()[0]) * 1024}


def child(code: str, arms: str, rev: str, out: Path) -> int:
    """One measurement (in its own process, so that its peak is its own)."""
    import torch

    torch.set_num_threads(1)
    from thinpipe.config import load_config
    from thinpipe.objective.registry import build_data
    from thinpipe.rank.from_config import load, place, val_batches

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="probe-memory-") as work:
        module = _probe_module(code, rev, Path(work))
        cfg = load_config(None, SETTINGS)
        if arms == "0":  # the floor: the model and the data, no arm
            loaded = load(cfg)
            place(cfg)
            _, val = build_data(cfg, loaded.tokenizer)
            _ = [b for _, b in zip(range(BATCHES), val_batches(val, cfg.train.batch_size))]
            rows, model = [], loaded.model
        else:
            names = None if arms == "all" else ["dense", *ARMS[:int(arms) - 1]]
            grid = list(module.GRID) if names is None else [a for a in module.GRID if a[0] in names]
            rows = module.probe(cfg, grid, num_batches=BATCHES, progress=False)["arms"]
            model = None
    peak = _peak()  # before loading the model again to count its parameters
    if model is None:
        model = load(cfg).model
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out.write_text(json.dumps({"code": code, "arms": len(rows), "rows": rows, "params": params,
                               "model_fp32_bytes": params * 4, "seconds": time.time() - t0, **peak}))
    return 0


def run(code: str, arms: str, rev: str, work: Path) -> dict:
    out = work / f"{code}-{arms}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "child", code, arms, rev, str(out)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=6 * 3600)
    if r.returncode != 0:
        raise SystemExit(f"{code}, {arms} arms failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def table(results: list[dict]) -> str:
    gib = 2 ** 30
    rows = ["| code | arms | peak RSS (GiB) | model fp32 (GiB) | peak / model fp32 | time (s) |",
            "|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['code']} | {r['arms']} | {r['ru_maxrss_bytes'] / gib:.2f} | "
                    f"{r['model_fp32_bytes'] / gib:.2f} | "
                    f"{r['ru_maxrss_bytes'] / r['model_fp32_bytes']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child(sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", nargs="*", default=["2", "6"], help="arm counts for the old probe (or 'all')")
    p.add_argument("--after", nargs="*", default=["0", "2", "6", "all"], help="arm counts for this probe (0: floor)")
    p.add_argument("--before-rev", default=BEFORE_REV)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="probe-memory-") as work:
        for code, counts in (("before", args.before), ("after", args.after)):
            for arms in counts:
                r = run(code, arms, args.before_rev, Path(work))
                results.append(r)
                print(f"{code}, {r['arms']} arms: peak RSS {r['ru_maxrss_bytes'] / 2**30:.2f} GiB "
                      f"({r['seconds']:.0f} s)", flush=True)
    # The same arms give the same results before and after (the fix changes memory, not numbers).
    same = {}
    for b in (r for r in results if r["code"] == "before" and r["arms"]):
        old = {x["arm"]: x for x in b["rows"]}
        for a in (r for r in results if r["code"] == "after"):
            new = {x["arm"]: x for x in a["rows"]}
            if set(old) <= set(new):
                same[f"before {b['arms']} arms == after {a['arms']} arms"] = all(old[k] == new[k] for k in old)
                break
    print(table(results))
    print("identical results:", same or "(nothing to compare)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "settings": SETTINGS, "batches": BATCHES,
        "arms_chosen": ["dense", *ARMS, "(the first N; the whole GRID for 'all'; run in GRID order)"],
        "before_rev": args.before_rev, **code_stamp(), "torch_threads": 1, "identical_results": same,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs",
        "unit": "bytes (ru_maxrss x 1024; VmHWM agrees)",
        "runs": [{k: v for k, v in r.items() if k != "rows"} | {"arm_names": [x["arm"] for x in r["rows"]]}
                 for r in results]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
