"""MAPL at small scale (MAPL Tables 1, 5, 6 and beyond): every arm token-matched.

Pretraining suites: the `small-llama` preset (hidden 128, 8 layers, byte-level vocab 512, 1.7 M
parameters) from scratch on the MATH training text, P = 4 stages (P = 8 in `p8`), Muon (Polar
Express) for hidden matrices + AdamW at 0.5x for the rest (MAPL App. E.3), 200 steps of 16 x 256
tokens (819,200 tokens per arm). Ranks scale Table 1's to d = 128: r = 32 (4x vs bf16) and r = 16 (8x).
Adaptation suite: SmolLM2-135M on MATH with the anchor-priors recipe (100 steps, 4 x 128 tokens,
AdamW lr 1e-4), MAPL at r = 28 (the PP bytes of M95: 29 kept values), random vs PCA start.

    .venv/bin/python experiments/mapl/run.py --suite main     # then: experiments/mapl/report.py
    .venv/bin/python experiments/mapl/run.py --suite 150m     # llama-150m: Uncompressed vs MAPL r32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arms import run_suite, select  # noqa: E402

PRETRAIN = {"model.name": "small-llama", "data.name": "math", "mesh.pp": 4, "train.batch_size": 16,
            "train.seq_len": 256, "train.microbatches": 4, "train.steps": 200, "train.optimizer": "muon",
            "train.lr": 0.02, "train.grad_clip": 0, "train.weight_decay": 0.01, "data.val_rows": 64,
            "eval.every": 25, "train.checkpoint_every": 0, "train.dtype": "float32", "boundary.dtype": "bfloat16"}
# MAPL's smallest Table 1 row at its real shape (issue 38): llama-150m (App. E.1; the 32k BPE), from scratch on the
# MATH training text, P = 4, Muon + AdamW as PRETRAIN; 300 steps of 4 x 128 tokens (a CPU budget: ~10-15 s a step),
# checkpointed every 20 steps so an interrupted suite resumes (experiments/arms.py)
SCALE150 = {**PRETRAIN, "model.name": "llama-150m", "train.batch_size": 4, "train.seq_len": 128,
            "train.microbatches": 2, "train.steps": 300, "data.val_rows": 32, "eval.every": 50,
            "train.checkpoint_every": 20}
ADAPT = {"model.name": "smollm2-135m", "data.name": "math", "mesh.pp": 4, "train.batch_size": 4,
         "train.seq_len": 128, "train.microbatches": 2, "train.steps": 100, "train.lr": 1e-4,
         "data.val_rows": 32, "eval.every": 20, "model.tied": "untie", "train.checkpoint_every": 0}


def mapl(r, **kw):
    return {"boundary.kind": "mapl", "boundary.rank": r, **kw}


SUITES = {
    "main": {"Uncompressed": {},
             "SSN r32": {"boundary.kind": "ssn", "boundary.rank": 32},
             "SSN-AdamW r32": {"boundary.kind": "ssn", "boundary.rank": 32, "train.optimizer": "adamw",
                               "train.lr": 3e-3},
             "MAPL r32": mapl(32), "MAPL+VQ r32": {**mapl(32), "boundary.kind": "mapl-vq"},
             "SSN r16": {"boundary.kind": "ssn", "boundary.rank": 16},
             "MAPL r16": mapl(16), "MAPL+VQ r16": {**mapl(16), "boundary.kind": "mapl-vq"}},
    "table5": {"fixed r32": mapl(32, **{"boundary.projector_optim": "fixed"}),
               "Muon r32": mapl(32, **{"boundary.projector_optim": "muon"})},
    # arm names keep "anchor" (the stored results' folders); the key is boundary.offset (MAPL's per-stage offset)
    "table6": {f"anchor {a} r32": mapl(32, **{"boundary.offset": a}) for a in ("none", "static", "full")},
    "p8": {"Uncompressed P8": {"mesh.pp": 8}, "MAPL r32 P8": {**mapl(32), "mesh.pp": 8}},
    "adapt": {"MAPL r28 pca": mapl(28, **{"boundary.init": "pca"}), "MAPL r28 random": mapl(28)},
    "150m": {"Uncompressed 150M": {}, "MAPL r32 150M": mapl(32)},
}
BASES = {"adapt": ADAPT, "150m": SCALE150}
ALIASES = {"spel r32": "MAPL r32", "anchor factorized r32": "MAPL r32"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="main", choices=sorted(SUITES))
    ap.add_argument("--out", default="experiments/mapl/results")
    ap.add_argument("--jobs", type=int, default=2, help="arms run in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    ap.add_argument("--only", default="", help="comma-separated arm names to run")
    args = ap.parse_args()
    base = BASES.get(args.suite, PRETRAIN)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = {"base": base, "arms": SUITES[args.suite], **code_stamp()}
    (out / f"suite_{args.suite}.json").write_text(json.dumps(suite, indent=2))
    run_suite(select(SUITES[args.suite], args.only, args.suite), out, base, args.jobs, args.threads, ALIASES)


if __name__ == "__main__":
    main()
