"""Peak memory and step time of one stage at long packed sequences (issue 51; docs/memory.md, "Long sequences").

One forward and backward of a whole model as one stage (``SimMesh``, pp 1, fp32, the CPU) on one row of T tokens
packed with documents of 1,024-2,048 tokens (the paper's long-context mixture packs many documents per row), at
T = 2k / 8k / 32k, for each attention path (``model.attention``: ``mask``, today's dense (1, 1, T, T) mask;
``packed``, issue 51's per-document kernels) with and without ``train.activation_checkpointing``. Each arm runs in
a fresh process (its peak RSS is the process's own: ``resource.getrusage``); the step is timed after one warm-up
step. The mask path is not run at 32k: it did not fit (one such step of small-llama grew past 24 GB and was
killed: issue 51).

Then the issue's checkpointing case: one step of ``llama-150m`` (one stage, LoRA rank 16, T = 2048, the default
4 rows) without and with ``train.activation_checkpointing``: peaks and losses.

Then one training step of ``--model`` at ``--engine-length`` tokens (2 stages, synthetic data packed into the
row) in both engines, ``thinpipe train`` (the simulation) and ``thinpipe launch --nproc 2`` (two real processes):
their wall time, the simulation's peak RSS (``RUSAGE_CHILDREN``; a dist rank's is not visible there) and losses,
which must be equal. And
two steps of each frontier codec, and of the mask boundary with the anchor circuit, at that length in the
simulation (``--codecs``).

    .venv/bin/python benchmarks/long_sequences.py [--model small-llama] [--lengths 2048 8192 32768]
        [--engine-length 32768] [--out benchmarks/results/long_sequences.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARM = r"""
import json, random, resource, sys, time
import torch
torch.set_num_threads(2)
from thinpipe.config import load_config
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.rank.from_config import load
model, T, attention, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
rows_, lora, warm = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
cfg = load_config(None, [f"model.name={model}", "mesh.pp=1", f"train.batch_size={rows_}", f"train.seq_len={T}",
                         f"model.attention={attention}", f"train.activation_checkpointing={str(ckpt).lower()}",
                         f"train.lora.rank={lora}", "train.device=cpu", "train.dtype=float32"])
loaded = load(cfg)
mesh = SimMesh(loaded.model, cfg)
r = random.Random(0)
seg, doc, at = [], 0, 0
while at < T:
    n = min(r.randint(1024, 2048), T - at)
    seg += [doc] * n
    doc, at = doc + 1, at + n
ids = torch.randint(0, loaded.model.config.vocab_size, (rows_, T), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "labels": ids.clone(), "segment_ids": torch.tensor([seg] * rows_)}
if warm:
    mesh.forward_backward([batch])  # warm-up
t0 = time.perf_counter()
loss = mesh.forward_backward([batch])
step_s = time.perf_counter() - t0
print(json.dumps({"loss": loss, "step_s": step_s, "documents": doc,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_arm(model: str, length: int, attention: str, ckpt: bool, rows: int = 1, lora: int = 0,
            warm: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-c", ARM, model, str(length), attention, "1" if ckpt else "0", str(rows),
                          str(lora), "1" if warm else "0"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


PEAK = r"""
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr[-3000:])
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


CODECS = {"mask + anchor circuit": ["boundary.kind=mask", "mesh.anchor=1", "anchor.every=1", "anchor.staleness=1"],
          "topk": ["boundary.kind=topk"], "outlier": ["boundary.kind=outlier"], "klt": ["boundary.kind=klt"],
          "aqsgd": ["boundary.kind=aqsgd"], "mapl": ["boundary.kind=mapl", "boundary.rank=32"],
          "mapl-vq": ["boundary.kind=mapl-vq", "boundary.rank=32"]}


def run_engine(engine: str, model: str, length: int, out: Path, more: list[str] = (), steps: int = 1) -> dict:
    """``steps`` training steps in ``engine`` (``sim``: thinpipe train; ``dist``: thinpipe launch --nproc 2)."""
    sets = [f"model.name={model}", "data.name=synthetic", "mesh.pp=2", f"train.steps={steps}", "train.batch_size=1",
            f"train.seq_len={length}", "data.val_rows=1", "train.checkpoint_every=0", *more]
    head = ["train"] if engine == "sim" else ["launch", "--nproc", "2", "--", "train"]
    cmd = [sys.executable, "-m", "thinpipe", *head, "--out", str(out), "--quiet", "--overwrite",
           *[x for s_ in sets for x in ("--set", s_)]]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    code, peak = (int(x) for x in r.stdout.split())
    if code != 0:
        return {"engine": engine, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    s = json.loads((out / "summary.json").read_text())
    # the dist ranks are forked by the launcher's forkserver (commands/rank_starter.py), whose children's peaks
    # RUSAGE_CHILDREN does not see: only the simulation's peak is recorded
    return {"engine": engine, "T": length, "wall_s": wall, "step_wall_s": s["wall_s"],
            "peak_rss_bytes": peak if engine == "sim" else None,
            "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"]}


def main() -> int:
    from thinpipe.provenance import code_stamp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--engine-length", type=int, default=32768)
    ap.add_argument("--codecs", action=argparse.BooleanOptionalAction, default=True,
                    help="also 2 steps of each frontier codec and of the anchor circuit at --engine-length")
    ap.add_argument("--checkpointing-case", action=argparse.BooleanOptionalAction, default=True,
                    help="also the llama-150m LoRA step with and without train.activation_checkpointing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_sequences.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'T':>6} {'attention':>9} {'ckpt':>5} {'peak GiB':>9} {'step s':>8} {'loss':>8}")
    for length in args.lengths:
        for attention in ("mask", "packed"):
            if attention == "mask" and length > 8192:
                continue  # did not fit (module docstring)
            for ckpt in (False, True):
                t0 = time.perf_counter()
                r = {"T": length, "attention": attention, "activation_checkpointing": ckpt,
                     **run_arm(args.model, length, attention, ckpt), "arm_wall_s": time.perf_counter() - t0}
                rows.append(r)
                peak = r.get("peak_rss_bytes", float("nan")) / 2**30
                print(f"{length:>6} {attention:>9} {str(ckpt):>5} {peak:>9.2f} {r.get('step_s', float('nan')):>8.2f}"
                      f" {r.get('loss', float('nan')):>8.4f} {r.get('error', '')}", flush=True)
    # the case: llama-150m, one stage, LoRA rank 16, T = 2048, the default 4 rows, one step (no warm-up:
    # the peak is what is compared), without and with activation checkpointing
    case = []
    if args.checkpointing_case:
        for ckpt in (False, True):
            r = {"model": "llama-150m", "T": 2048, "rows": 4, "lora_rank": 16, "activation_checkpointing": ckpt,
                 **run_arm("llama-150m", 2048, "packed", ckpt, rows=4, lora=16, warm=False)}
            case.append(r)
            peak, step = r.get("peak_rss_bytes", float("nan")) / 2**30, r.get("step_s", float("nan"))
            print(f"llama-150m LoRA 16, 4 x 2048, checkpointing {ckpt}: peak {peak:.2f} GiB, step {step:.1f} s, "
                  f"loss {r.get('loss')}", flush=True)
        if all("peak_rss_bytes" in r for r in case):
            print(f"checkpointing peak / without: {case[1]['peak_rss_bytes'] / case[0]['peak_rss_bytes']:.3f}")
    import tempfile

    engines = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("sim", "dist"):
            e = run_engine(engine, args.model, args.engine_length, Path(tmp) / engine)
            engines.append(e)
            print(f"{engine}: one step at T = {args.engine_length}: " + json.dumps(e), flush=True)
        # the codecs and the anchor circuit at this length (their per-token state must not assume a short row)
        codecs = []
        if args.codecs:
            for name, more in CODECS.items():
                c = {"codec": name, **run_engine("sim", args.model, args.engine_length, Path(tmp) / "codec", more, 2)}
                codecs.append(c)
                print(f"{name}: 2 steps at T = {args.engine_length}: " + json.dumps(c), flush=True)
    same = all("final_train_loss" in e for e in engines) and len(
        {(e["final_train_loss"], e["final_val_loss"]) for e in engines}) == 1
    print(f"sim and dist losses equal: {same}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows, "checkpointing_case": case,
                                          "engines": engines, "codecs": codecs,
                                          "engines_equal": same, **code_stamp()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
