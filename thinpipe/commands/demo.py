"""The main job (`make demo`): SmolLM2-135M adapted on MATH over a simulated 4-stage pipeline:
dense boundaries vs 95% random activation masking (M95, paper §3.1) vs M95 with anchor priors and
the spectral correction (M95+AP, §3.2) vs the compressor with the best quality for its bytes in our
frontier experiment (``klt-dither`` without its dither, "KLTe": the activations in their own KLT basis,
uniform steps at 3.2 bits per dim on the scored tokens and 2 on the others, entropy coded, every
token's gradient at 1 bit; 885-911 PP B/token: 7.6x fewer than the bf16 wire a GPU sends with
``train.dtype = auto``, 15.2x fewer than an fp32 wire; +0.73% / +0.66% / +1.13% held-out loss after 100
steps on seeds 0 / 1 / 2, mean +0.84%, where M95 is +44% and M90 +98%; experiments/frontier/README.md),
same steps and tokens. The table states compression against Dense's own wire (``thinpipe compare``) and ends by
naming the arms whose held-out loss is within 1% of Dense's (measured, not assumed) on the one seed
the demo runs, which it says: one seed is not a result at a 1% margin.

Short-run settings (not the paper's): lr 1e-4 so that 30 steps visibly adapt the model, and anchor
staleness delta = 10 so that a 30-step run consumes 2 priors (the paper's delta is 20-25).

Prints the arms side by side (``thinpipe compare`` of their run folders: held-out loss best and
final, bytes per token per axis, compression against Dense, tokens/s) and writes
``<out>/demo_summary.json``, ``<out>/compare.json`` and ``<out>/demo_loss.png`` (held-out loss
against step and against PP bytes sent).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from thinpipe.commands.compare import compare, format_table, plot
from thinpipe.config import Config, apply_overrides
from thinpipe.provenance import code_stamp

NAME = "demo"
HELP = "the main job: SmolLM2 on math, 4 stages, dense vs M95"

# Sized to finish in about 9 minutes on 2 idle CPU cores (~4 s per step at 4 x 128 tokens, 4 arms).
FULL = {"model.name": "smollm2-135m", "data.name": "math", "mesh.pp": 4, "train.steps": 30,
        "train.batch_size": 4, "train.seq_len": 128, "train.microbatches": 2, "train.lr": 1e-4,
        "data.val_rows": 16, "eval.every": 10,
        # Syncing the tied embedding between stage 0 and stage 3 would move 2 x 49152 x 576 fp32
        # values per step (~440 KB/token): for a thin pipe we let the two copies drift instead.
        "model.tied": "untie"}
QUICK = {"model.name": "tiny-llama", "data.name": "synthetic", "mesh.pp": 4, "train.steps": 30,
         "train.batch_size": 4, "train.seq_len": 64, "train.microbatches": 2, "train.lr": 1e-3,
         "data.val_rows": 8, "eval.every": 10, "optim.spectral.rank": 8}
ARMS = {"Dense": {"boundary.kind": "identity"},
        "M95": {"boundary.kind": "mask", "boundary.p": 0.95},
        "M95+AP": {"boundary.kind": "mask", "boundary.p": 0.95, "mesh.anchor": 1, "anchor.staleness": 10},
        "KLTe 3.2-2b T100": {"boundary.kind": "klt-dither", "boundary.bwd_bits": 1, "boundary.pca_batches": 16,
                             "boundary.klt-dither.bits": 3.2, "boundary.klt-dither.context_bits": 2.0,
                             "boundary.klt-dither.bwd_tokens": 1.0, "boundary.klt-dither.dither": False}}
KEEPS_QUALITY = 0.01  # within 1% of Dense's final held-out loss


def arm_config(base: dict, arm: dict) -> Config:
    cfg = Config()
    apply_overrides(cfg, {**base, **arm})
    return cfg.validate()


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--quick", action="store_true", help="tiny model, seconds (for tests)")


def run(args) -> int:
    return run_demo(args.out, quick=args.quick)


def run_demo(out: str | Path, quick: bool = False) -> int:
    from thinpipe.engine.sim_engine import train  # the model libraries: loaded when the demo runs

    out = Path(out)
    base = QUICK if quick else FULL
    results = {}
    t0 = time.perf_counter()
    for name, arm in ARMS.items():
        print(f"== {name}: {', '.join(f'{k}={v}' for k, v in arm.items())}")
        results[name] = train(arm_config(base, arm), out / name)
    side_by_side = compare([out / name for name in ARMS])  # the summary is `thinpipe compare` of the arms
    print(format_table(side_by_side))
    print(keeps_quality(results, arm_config(base, ARMS["Dense"]).train.seed))
    print("anchor B/tok = the anchor circuit's weight pull + unmasked PP pass + gradient push, off the critical path;\n"
          "tok/s is this CPU's simulation speed, not a mesh's.")
    (out / "demo_summary.json").write_text(json.dumps({"base": base, "arms": ARMS, "results": results,
                                                                **code_stamp()}, indent=2))
    (out / "compare.json").write_text(json.dumps(side_by_side, indent=2))
    plot(side_by_side, out / "demo_loss.png")
    again = " ".join(shlex.quote(str(out / name)) for name in ARMS)
    print(f"total {time.perf_counter() - t0:.0f} s; results in {out}/ "
          f"(`thinpipe compare {again}` shows this table again)")
    return 0


def keeps_quality(results: dict, seed: int) -> str:
    """The line naming the arms whose final held-out loss is within KEEPS_QUALITY of Dense's, and the one
    seed (``train.seed``) it rests on: on the demo's own recipe issue 17's min/max Outlier 4b-1b vs Dense
    is -0.0% / +1.24% / +0.34% on seeds 0 / 1 / 2 (measured by issue 26's author), so one seed can say
    "within" where another says "not"."""
    dense = results["Dense"]
    kept = [n for n, s in results.items() if n != "Dense"
            and s["final_val_loss"] <= dense["final_val_loss"] * (1 + KEEPS_QUALITY)]
    others = "; the others lose quality for their bytes" if len(kept) < len(results) - 1 else ""
    return (f"within {KEEPS_QUALITY:.0%} of Dense's held-out loss on 1 seed (seed {seed}): "
            f"{', '.join(kept) if kept else 'none'}{others}; one seed is not a result at a {KEEPS_QUALITY:.0%} "
            "margin: see experiments/frontier/README.md for the paired 3-seed table")
