"""Predicted vs measured peak memory per rank (issue 51; docs/memory.md, "Predicted per rank").

For each setting, ``thinpipe plan``'s memory model (``thinpipe/plan/memory.py: predict``, ``--device cpu``) beside
the peak resident set each rank of the same dist job reaches (``benchmarks/stage_memory.py: run_job``: torchrun,
each rank's ``getrusage(RUSAGE_SELF).ru_maxrss`` after the whole job, the model's write at its end included).
The scale presets ``llama-150m`` and ``llama-500m``, 1 and 4 stages, LoRA (rank 16) and full fine-tuning,
T = 512 and 2,048; two rows of T per step in two microbatches (1F1B: stage s of 4 holds min(4 - s, 2) in flight),
two steps (the second step's backward holds the optimizer's state beside the activations), fp32. Writes
``benchmarks/results/memory_prediction.json`` and prints the table docs/memory.md shows.

    .venv/bin/python benchmarks/memory_prediction.py            # ~40 minutes on 2 cores
    .venv/bin/python benchmarks/memory_prediction.py --models llama-150m --seq-lens 512   # one corner
    .venv/bin/python benchmarks/memory_prediction.py --repredict   # the committed measurements, predicted by this code
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_memory import SETTINGS, run_job  # noqa: E402  (this folder's benchmark: one dist job's peaks)

from thinpipe.config import load_config  # noqa: E402
from thinpipe.plan.memory import predict  # noqa: E402
from thinpipe.plan.planner import ARCHITECTURES  # noqa: E402
from thinpipe.provenance import code_stamp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "memory_prediction.json"
BASE = [s for s in SETTINGS if s.split("=")[0] not in ("model.name", "model.tied", "train.batch_size",
                                                       "train.microbatches", "train.seq_len", "train.steps")]
BASE += ["train.batch_size=2", "train.microbatches=2", "train.steps=2"]


def settings(model: str, stages: int, lora: bool, seq_len: int) -> list[str]:
    return [*BASE, f"model.name={model}", f"train.seq_len={seq_len}", *(["train.lora.rank=16"] if lora else [])]


def table(rows: list[dict]) -> str:
    out = ["| model | training | T | stages | predicted peak per rank (GiB) | measured (GiB) | predicted / measured |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, meas = r["predicted_bytes"], r["measured_bytes"]
        out.append(f"| {r['model']} | {'LoRA r16' if r['lora'] else 'full'} | {r['seq_len']} | {r['stages']} | "
                   f"{', '.join(f'{p / 2**30:.2f}' for p in pred)} | {', '.join(f'{m / 2**30:.2f}' for m in meas)} | "
                   f"{', '.join(f'{p / m:.2f}' for p, m in zip(pred, meas))} |")
    return "\n".join(out)


def repredict(path: Path) -> int:
    """The measured rows of ``path`` predicted again by the current ``plan/memory.py``: the file keeps the
    measurements and their code stamp (``measured_with``), and records this code's stamp for the predictions."""
    data = json.loads(path.read_text())
    for row in data["rows"]:
        cfg = load_config(None, [*settings(row["model"], row["stages"], row["lora"], row["seq_len"]),
                                 f"mesh.pp={row['stages']}"])
        row["prediction"] = predict(cfg, ARCHITECTURES[row["model"]], "cpu")
        row["predicted_bytes"] = [r["peak_bytes"] for r in row["prediction"]["ranks"]]
    data.setdefault("measured_with", {k: data.get(k) for k in ("version", "commit", "dirty")})
    data["predicted_with"] = code_stamp()
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data["rows"]))
    ratios = [p / m for r in data["rows"] for p, m in zip(r["predicted_bytes"], r["measured_bytes"])]
    print(f"predicted / measured: {min(ratios):.3f} .. {max(ratios):.3f} over {len(ratios)} ranks")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama-150m", "llama-500m"])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--training", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--repredict", action="store_true",
                   help="keep the results file's measured peaks and predict them again with this code (no jobs run)")
    args = p.parse_args()
    if args.repredict:
        return repredict(args.results)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-prediction-") as work:
        for model in args.models:
            for lora in [x == "lora" for x in args.training]:
                for seq_len in args.seq_lens:
                    for stages in args.stages:
                        sets = settings(model, stages, lora, seq_len)
                        cfg = load_config(None, [*sets, f"mesh.pp={stages}"])
                        pred = predict(cfg, ARCHITECTURES[model], "cpu")
                        t0 = time.perf_counter()
                        name = f"{model}-{'lora' if lora else 'full'}-T{seq_len}"
                        folder = Path(work) / f"{name}-pp{stages}"
                        folder.mkdir()
                        meas = run_job(stages, "after", folder, sets)
                        shutil.rmtree(folder)  # ours; a 500M job's model is 2.4 GB
                        row = {"model": model, "lora": lora, "seq_len": seq_len, "stages": stages,
                               "predicted_bytes": [r["peak_bytes"] for r in pred["ranks"]], "measured_bytes": meas,
                               "job_s": round(time.perf_counter() - t0, 1), "prediction": pred}
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
                        args.results.parent.mkdir(parents=True, exist_ok=True)  # after each job: nothing lost
                        args.results.write_text(json.dumps({
                            "settings": BASE, "unit": "bytes (ru_maxrss x 1024; the prediction's peak_bytes)",
                            **code_stamp(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                            "rows": rows}, indent=1) + "\n")
    print(table(rows))
    ratios = [p / m for r in rows for p, m in zip(r["predicted_bytes"], r["measured_bytes"])]
    print(f"predicted / measured: {min(ratios):.3f} .. {max(ratios):.3f} over {len(ratios)} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
