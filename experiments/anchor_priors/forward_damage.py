"""How much does compressing PP boundaries damage the *forward* of the pretrained model, before any
training? The masked circuit trains on this damaged function, so it bounds what masking can do.

Held-out loss (nats/token) of SmolLM2-135M, 4 stages, on MATH-500 rows, with the library's own
MaskBoundary at every boundary (or at one), with and without the 1/(1-p) rescale; plus two
reference fills that need side information the wire does not carry (per-dim mean fill, PCA-k).

    .venv/bin/python experiments/anchor_priors/forward_damage.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from thinpipe.boundary import MaskBoundary
from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.data import batches, build_dataset
from thinpipe.models import build_stages, load_model
from thinpipe.provenance import code_stamp
from thinpipe.rank.context import make_contexts


@torch.no_grad()
def loss_with(stages, ctx, transform) -> float:
    """Run the stages, applying ``transform(boundary_index, x) -> x_hat`` between them."""
    x = ctx.input_ids
    for s, st in enumerate(stages):
        x = st(x, ctx)
        if s < len(stages) - 1:
            x = transform(s, x)
    return float(x)


def mask_transform(p: float, rescale: bool, only: int | None, hidden: int):
    bounds = {b: MaskBoundary(b, hidden, p, seed=0, rescale=rescale) for b in range(8)}
    mctx = SimpleNamespace(step=0, microbatch=0, replica=0)

    def f(b, x):
        if only is not None and b != only:
            return x
        _, payload = sender_forward(bounds[b], x, mctx)
        return receiver_forward(bounds[b], payload, mctx, x.dtype)[1].detach()
    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", default="experiments/anchor_priors/results/forward_damage.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    hidden = loaded.model.config.hidden_size
    stages = build_stages(loaded.model, None, 4)
    val = build_dataset("math", loaded.tokenizer, 128, "val", 0)
    ctx = make_contexts(next(batches(val, args.rows, seed=0)), 1, 0, 0)[0]
    fit = make_contexts(next(batches(build_dataset("math", loaded.tokenizer, 128, "train", 0, 400), 16, seed=1)),
                        1, 0, 0)[0]
    acts = []
    loss_with(stages, fit, lambda b, x: (acts.append(x.reshape(-1, hidden)), x)[1])
    means = [a.mean(0) for a in acts]
    pcs = [torch.linalg.svd(a - m, full_matrices=False)[2] for a, m in zip(acts, means)]

    rows = [{"method": "dense", "boundaries": "-", "p": 0.0, "loss": loss_with(stages, ctx, lambda b, x: x)}]
    for p in (0.1, 0.5, 0.9, 0.95):
        for rescale in (True, False):
            rows.append({"method": f"mask{' +rescale' if rescale else ''}", "boundaries": "all", "p": p,
                         "loss": loss_with(stages, ctx, mask_transform(p, rescale, None, hidden))})
        for only in range(3):
            rows.append({"method": "mask +rescale", "boundaries": str(only), "p": p,
                         "loss": loss_with(stages, ctx, mask_transform(p, True, only, hidden))})
    for p in (0.9, 0.95):
        k = max(1, round((1 - p) * hidden))
        masker = mask_transform(p, False, None, hidden)

        def mean_fill(b, x, masker=masker):
            kept = masker(b, x) != 0
            return torch.where(kept, x, means[b])

        rows.append({"method": "mask, dropped dims filled with their mean (side info)", "boundaries": "all", "p": p,
                     "loss": loss_with(stages, ctx, mean_fill)})
        rows.append({"method": f"PCA-{k} of centred activations (side info)", "boundaries": "all", "p": p,
                     "loss": loss_with(stages, ctx, lambda b, x, k=k: ((x - means[b]) @ pcs[b][:k].T) @ pcs[b][:k]
                                       + means[b])})
    n_loss = int((ctx.labels[:, 1:] != -100).sum())
    for r in rows:
        r["loss"] = r["loss"] / ctx.loss_scale / n_loss
    print(f"SmolLM2-135M, 4 stages, {args.rows} MATH-500 rows x 128 tokens, no training")
    print(f"{'method':<58}{'bound.':>7}{'p':>6}{'loss':>8}")
    for r in rows:
        print(f"{r['method']:<58}{r['boundaries']:>7}{r['p']:>6.2f}{r['loss']:>8.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([{**r, **code_stamp()} for r in rows], indent=2))


if __name__ == "__main__":
    main()
