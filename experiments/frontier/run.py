"""The frontier: held-out loss against PP bytes on the anchor-priors recipe, on paired seeds (README.md).

Recipe: experiments/anchor_priors (SmolLM2-135M, 4 stages, MATH, 4 x 128 tokens per step, 100 steps,
lr 1e-4, held-out loss every 20 steps on 32 MATH-500 rows), so that its committed arms (Dense, M90,
M95, top-K 95%, the anchor arms) sit on the same table. A setting is an arm name and its overrides;
``--seeds`` runs it on each seed (``train.seed``; the held-out rows do not depend on it, so the seeds
pair: the same rows score Dense and the arm) and ``--steps`` at another length. Folders:
``results/<arm>`` for seed 0 at 100 steps, ``<arm>_seed_<s>``, ``..._steps_<n>``. Every run
checkpoints every 20 steps and resumes from there when the suite is started again.

    .venv/bin/python experiments/frontier/run.py --only "Dense,Outlier 4b-1b tok" --seeds 0,1,2 [--jobs 2]
    .venv/bin/python experiments/frontier/run.py --only Dense --seeds 0 --steps 300
    .venv/bin/python experiments/frontier/report.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anchor_priors.run import BASE  # noqa: E402  (the same recipe, by construction)
from arms import arm_dir, run_suite, select  # noqa: E402

FRONTIER_BASE = {**BASE, "train.checkpoint_every": 20}  # resumable; checkpoints do not change the run


def outlier(fwd: int, bwd: int, channels: int = 16, per_token: bool = False, **more) -> dict:
    arm = {"boundary.kind": "outlier", "boundary.fwd_bits": fwd, "boundary.bwd_bits": bwd,
           "boundary.outlier_channels": channels}
    if per_token:  # one forward scale pair per token (36 -> 4 B) and bf16 intact channels (64 -> 32 B)
        arm.update({"boundary.outlier_scale_group": 576, "boundary.outlier_dtype": "bfloat16"})
    return {**arm, **{f"boundary.{k}": v for k, v in more.items()}}


def lm(fwd: int, bwd: int, channels: int = 16, **more) -> dict:
    """The outlier kind on the Lloyd-Max grid, one forward and one backward scale per token."""
    return outlier(fwd, bwd, channels, per_token=True, outlier_grid="lloyd-max", outlier_bwd_scale_group=-1, **more)


def klt(loss_bits: float, context_bits: float, bwd_tokens: float, bwd_bits: int = 1, **more) -> dict:
    """The klt kind: its basis fitted on 16 batches (8,192 tokens) at the start."""
    return {"boundary.kind": "klt", "boundary.klt_bits": loss_bits, "boundary.klt_context_bits": context_bits,
            "boundary.klt_bwd_tokens": bwd_tokens, "boundary.bwd_bits": bwd_bits, "boundary.pca_batches": 16,
            **{f"boundary.klt_{k}": v for k, v in more.items()}}


def kltd(loss_bits: float, context_bits: float, bwd_tokens: float, **more) -> dict:
    """The klt-dither kind: the klt basis (16 batches at the start), dithered uniform steps, entropy coded."""
    return {"boundary.kind": "klt-dither", "boundary.klt-dither.bits": loss_bits,
            "boundary.klt-dither.context_bits": context_bits, "boundary.klt-dither.bwd_tokens": bwd_tokens,
            "boundary.bwd_bits": 1, "boundary.pca_batches": 16,
            **{f"boundary.klt-dither.{k}": v for k, v in more.items()}}


ARMS = {
    "Dense": {},
    "Outlier 2b-2b": outlier(2, 2),
    "Outlier 2b-1b": outlier(2, 1),
    "Outlier 1b-1b": outlier(1, 1),
    # 2b-1b vs 2b-2b: the backward's bits barely matter, the forward's do; the same bytes as 2b-2b
    # spent on the forward instead:
    "Outlier 3b-1b": outlier(3, 1),
    "Outlier 4b-1b": outlier(4, 1),
    "4-bit Quant": {"boundary.kind": "quant4"},
    "2-bit Quant": {"boundary.kind": "quant2"},
    "TAH-Quant 2-8": {"boundary.kind": "tahquant"},
    "TopK90": {"boundary.kind": "topk", "boundary.p": 0.9},          # top-K's second ratio (TopK95 is committed)
    # ~10x; r28 is committed
    "MAPL r58 pca": {"boundary.kind": "mapl", "boundary.rank": 58, "boundary.init": "pca", "diag.every": 0},
    # 3b-1b ended +1.08% at 10.9x: the forward's bytes on bits instead of scales and fp32 channels
    "Outlier 4b-1b tok": outlier(4, 1, per_token=True),
    "Outlier 3b-1b tok": outlier(3, 1, per_token=True),
    # the forward/backward split of the best arm's loss (the other direction dense; README: "Forward or backward?")
    "Outlier 4b-1b tok fwd only": outlier(4, 1, per_token=True, compress="fwd"),
    "Outlier 4b-1b tok bwd only": outlier(4, 1, per_token=True, compress="bwd"),
    # the new codecs (README: "New codecs"): Lloyd-Max grid (LM), per-token backward scales,
    # token-sparse backward (T = kept share)
    "LM 4b-1b tok": lm(4, 1),
    "LM 3b-1b tok": lm(3, 1),
    "LM 2b-1b tok": lm(2, 1),
    "LM 2b-2b tok T50": lm(2, 2, outlier_bwd_tokens=0.5),
    "LM 2b-1b tok T50": lm(2, 1, outlier_bwd_tokens=0.5),
    "LM 2b-1b tok T25": lm(2, 1, outlier_bwd_tokens=0.25),
    "LM 2b-1b tok C32 T25": lm(2, 1, channels=32, outlier_bwd_tokens=0.25),
    "LM 1b-1b tok C8 T25": lm(1, 1, channels=8, outlier_bwd_tokens=0.25),
    "LM 1b-1b tok T25": lm(1, 1, outlier_bwd_tokens=0.25),
    # the middle boundary is the sensitive one (probe --boundaries: 2-bit +10.2% there, +2.4% / +5.7% at the ends)
    "LM 2-3-2b-1b tok T25": lm(2, 1, outlier_fwd_bits=[2, 3, 2], outlier_bwd_tokens=0.25),
    "LM 2-3-2b-1b tok C8 T50": lm(2, 1, channels=8, outlier_fwd_bits=[2, 3, 2], outlier_bwd_tokens=0.5),
    # between LM 3b (probe +5.0%) and LM 4b (+1.4%, trained +0.77%): the sensitive middle boundary at 4 bits
    "LM 3-4-3b-1b tok": lm(3, 1, outlier_fwd_bits=[3, 4, 3]),
    # issue 36: transform coding in the activations' KLT basis, bits by reverse water-filling, loss / context
    # tokens at their own bits, the token-sparse Lloyd-Max backward (T = kept share). The first arms: one scale
    # per token and 16 intact channels ("tok C16"; their heavy tokens clip: README "The KLT codec")
    **{f"KLT {lb}-{cb}b-1b T{round(t * 100)}": klt(lb, cb, t, scale="token", channels=16) for lb, cb, t in
       ((3, 1, 0.5), (3.5, 1, 0.5), (4, 1, 0.5), (3, 1.5, 0.5), (2.5, 1, 0.5), (3, 1, 1.0), (2, 1, 0.5), (3, 0.5, 0.5),
        (3, 3, 0.5))},
    # one scale per token and bit width, 4 intact channels (the kind's defaults)
    **{f"KLTw {lb}-{cb}b-1b T{round(t * 100)}": klt(lb, cb, t) for lb, cb, t in
       ((3, 1, 0.5), (2.5, 1, 0.5), (2, 1, 0.5), (3, 1, 0.75), (3, 1, 1.0), (2.5, 1, 0.75), (3, 1.5, 0.5),
        (2.5, 0.5, 0.5))},
    "KLTw 3-1b-1b T50 C16": klt(3, 1, 0.5, channels=16),
    # T75 with its side bytes: 708 B/token on 100 steps; an 8-bit basis (-19) and 70% of the gradients (-10)
    "KLTw 3-1b-1b T70 q8": klt(3, 1, 0.7, basis_dtype="int8"),
    # diagnosis: every token's gradient (722 B/token: above the milestone)
    "KLTw 3-1b-1b T100 q8": klt(3, 1, 1.0, basis_dtype="int8"),
    # both ends refit the forward basis and fit the gradient's own every 20 steps (no bytes)
    "KLTw 3-1b-1b T75 R20": klt(3, 1, 0.75, refresh_every=20),
    # issue 52's diagnosis: T70 q8 with its forward replaced by zero-mean noise of the codec's own error power per
    # KLT direction and token class, fresh each step (dense on the wire: a question, not a codec)
    "KLTw 3-1b-1b T70 q8 noise-equivalent": klt(3, 1, 0.7, basis_dtype="int8", noise_equivalent=True),
    # issue 52 items 2-4: the unbiased (dithered), entropy-coded forward on the same basis, int8; bits = the coder's
    # model entropy per dim (scored / context tokens), a token-sparse 1-bit backward (T = kept share)
    **{f"KLTd {lb:g}-{cb:g}b-1b T{round(t * 100)}": kltd(lb, cb, t) for lb, cb, t in ((3.2, 2, 0.5), (3.5, 2, 0.5))},
    "KLTe 3.2-2b-1b T50": kltd(3.2, 2.0, 0.5, dither=False),  # plain ECSQ: the same coder, no dither
    # KLTe's three seeds: +0.61 / +1.50 / +1.71%; more forward bits (the probe's forward cosine picks among them)
    **{f"KLTe {lb:g}-{cb:g}b-1b T{round(t * 100)}": kltd(lb, cb, t, dither=False) for lb, cb, t in
       ((3.5, 2, 0.5), (4, 2, 0.5), (4, 3, 0.5), (4.5, 3, 0.5))},
    # 4-3b did no better than 3.2-2b: what the KLT arms share against LM 4b-1b tok is the half-token backward
    "KLTe 3.2-2b-1b T100": kltd(3.2, 2.0, 1.0, dither=False),
    # toward 10x (<= 691 B/token): what fewer forward bits cost with every token's gradient
    "KLTe 2.8-1.5b-1b T100": kltd(2.8, 1.5, 1.0, dither=False),
    # T50's top-K by norm is biased (small-gradient tokens never cross); "s": half the tokens drawn, unbiased
    # (boundary.klt-dither.bwd_select = sample: kept with probability ~ norm, scaled by its inverse; the same bytes)
    **{f"KLTe {lb:g}-{cb:g}b-1b T{round(t * 100)}s": kltd(lb, cb, t, dither=False, bwd_select="sample")
       for lb, cb, t in ((2.8, 1.5, 0.5), (3.2, 2, 0.5))},
    # the same forward with T50's top-K: what the draw changed
    "KLTe 2.8-1.5b-1b T50": kltd(2.8, 1.5, 0.5, dither=False),
    # issue 52 item 4 on outlier: LM 4b-1b tok's codes entropy coded (lossless: its gaps, bitwise; its bytes, screened)
    "LM 4b-1b tok E": lm(4, 1, outlier_entropy=True),
}


def run_folder(out: Path, arm: str, seed: int, steps: int) -> Path:
    name = arm + (f" seed {seed}" if seed else "") + (f" steps {steps}" if steps != BASE["train.steps"] else "")
    return arm_dir(out, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/frontier/results")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--only", default="", help="comma-separated arm names to run")
    ap.add_argument("--seeds", default="0", help="comma-separated train.seed values, e.g. 0,1,2")
    ap.add_argument("--steps", type=int, default=BASE["train.steps"], help="steps per run (the 3x check: 300)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps({"base": FRONTIER_BASE, "arms": ARMS, **code_stamp()}, indent=2))
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {}
    for name, sets in select(ARMS, args.only, "frontier").items():
        for seed in seeds:
            folder = run_folder(out, name, seed, args.steps)
            runs[folder.name] = ({**sets, "train.seed": seed, "train.steps": args.steps}, folder)
    run_suite({k: v[0] for k, v in runs.items()}, out, FRONTIER_BASE, args.jobs, args.threads,
              folders={k: v[1] for k, v in runs.items()})
    for _, folder in runs.values():
        if (folder / "summary.json").is_file():  # a finished run: its checkpoints and its model (weights) go
            shutil.rmtree(folder / "checkpoint", ignore_errors=True)
            shutil.rmtree(folder / "model", ignore_errors=True)


if __name__ == "__main__":
    main()
