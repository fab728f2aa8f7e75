"""What the frontier's boundaries carry, measured before new codecs are designed (README.md: diagnosis).

On the frontier recipe's model and data (SmolLM2-135M, 4 stages, MATH held-out rows, 4 x 128 tokens
per batch) at the pretrained weights, a dense forward-backward of the simulated mesh records, at every
boundary, the activation sent forward and the activation gradient sent back. Then, per boundary:

- the activation: the share of its energy in the C = 16 outlier channels (calibrated on the training
  batches the ``outlier`` kind's residual start uses); the rotated
  rest (outliers zeroed, Hadamard tiles of 64) normalised by each token's RMS: excess kurtosis and the
  tail mass beyond 3 (how far from Gaussian);
- every grid at 1-4 bits on the rotated rest (min/max per tile as the ``outlier`` kind has it,
  min/max per token, Lloyd-Max per token / per tile): relative MSE (||x - q(x)||^2 / ||x||^2 over the
  whole activation, outlier channels sent intact) and the codes' empirical entropy in bits per value
  (what an ideal entropy coder would spend on them, before side information);
- the gradient: the share of its energy in the top 10 / 25 / 50% tokens by norm (per microbatch), its
  rotated excess kurtosis, and the relative MSE and cosine of the 1-2 bit grids.

    .venv/bin/python experiments/frontier/diagnose.py [--batches 2] [--out experiments/frontier/results/diagnose.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from thinpipe.boundary.lloyd_max import dequantize_rms, quantize_rms
from thinpipe.boundary.quant import dequantize, quantize
from thinpipe.boundary.tahquant import code_entropy, hadamard
from thinpipe.config import Config, apply_overrides
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.objective.registry import build_data
from thinpipe.provenance import code_stamp
from thinpipe.rank.from_config import load, place, residual_batches, val_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anchor_priors.run import BASE  # noqa: E402  (the frontier recipe)

TILE, CHANNELS = 64, 16
SEQ = BASE["train.seq_len"]


def capture(batches: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per boundary: activations (N, H), gradients (N, H), and the calibration activations."""
    cfg = Config()
    apply_overrides(cfg, {k: v for k, v in BASE.items() if not k.startswith(("eval.", "diag."))})
    cfg.validate()
    device = place(cfg)
    loaded = load(cfg)
    train_ds, val_ds = build_data(cfg, loaded.tokenizer)
    mesh = SimMesh(loaded.model, cfg, device)
    xs, gs = [[] for _ in mesh.boundaries], [[] for _ in mesh.boundaries]
    for b in mesh.boundaries:
        enc, enc_g = b.encode, b.encode_grad

        def encode(x, ctx, enc=enc, i=b.index):
            xs[i].append(x.detach().float().reshape(-1, x.shape[-1]).clone())
            return enc(x, ctx)

        def encode_grad(g, ctx, enc_g=enc_g, i=b.index):
            gs[i].append(g.detach().float().reshape(-1, g.shape[-1]).clone())
            return enc_g(g, ctx)

        b.encode, b.encode_grad = encode, encode_grad
    for i, batch in zip(range(batches), val_batches(val_ds, cfg.train.batch_size)):
        mesh.step_index = i
        mesh.forward_backward([batch])
    calib = [r.float().reshape(-1, r.shape[-1]) for r in mesh.boundary_residuals(residual_batches(cfg, train_ds))]
    return [torch.cat(x) for x in xs], [torch.cat(g) for g in gs], calib


def entropy_bits(codes: torch.Tensor, bits: int) -> float:
    """The empirical entropy of all the codes together (TAH-Quant's per-tile measure over one row)."""
    return float(code_entropy(codes.reshape(1, -1), bits))


def kurtosis(z: torch.Tensor) -> float:
    z = z.double().reshape(-1)
    z = (z - z.mean()) / z.std()
    return float((z ** 4).mean() - 3)


def grids(rot: torch.Tensor, bits: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (reconstruction of the rotated values, codes)."""
    h = rot.shape[-1]
    out = {}
    for name, g in (("minmax tile", TILE), ("minmax token", h)):
        c, lo, st = quantize(rot, bits, g)
        out[name] = (dequantize(c, lo, st, rot.shape), c)
    for name, g in (("lloyd-max token", h), ("lloyd-max tile", TILE)):
        c, s = quantize_rms(rot, bits, g)
        out[name] = (dequantize_rms(c, s, bits, rot.shape), c)
    return out


def rotate(t: torch.Tensor) -> torch.Tensor:
    return hadamard(t.reshape(-1, TILE)).reshape(t.shape)


def activation_stats(x: torch.Tensor, calib: torch.Tensor) -> dict:
    ch = calib.abs().mean(0).topk(CHANNELS).indices
    rest = x.clone()
    rest[:, ch] = 0
    rot = rotate(rest)
    z = rot / rot.pow(2).mean(1, keepdim=True).sqrt()
    energy = float(x.pow(2).sum())
    seqs = rest.reshape(-1, SEQ, rest.shape[-1])
    prev = seqs[:, :-1].reshape(-1, rest.shape[-1]), seqs[:, 1:].reshape(-1, rest.shape[-1])
    shared = {  # how much of the rest a receiver-side prior could take away before coding
        "rest_energy_in_sequence_mean": float(seqs.mean(1, keepdim=True).expand_as(seqs).pow(2).sum()
                                              / seqs.pow(2).sum()),
        "rest_energy_in_corpus_mean": float(rest.mean(0).pow(2).sum() * rest.shape[0] / rest.pow(2).sum()),
        "rest_cosine_with_previous_token": float(torch.nn.functional.cosine_similarity(*prev, dim=1).mean())}
    row = {**shared, "outlier_energy_share": float(x[:, ch].pow(2).sum()) / energy,
           "rotated_excess_kurtosis": kurtosis(z),
           "rotated_tail_beyond_3": float((z.abs() > 3).float().mean()), "gaussian_tail_beyond_3": 0.0027,
           "token_rms_cv": float(rest.pow(2).mean(1).sqrt().std() / rest.pow(2).mean(1).sqrt().mean()), "grids": {}}
    for bits in (1, 2, 3, 4):
        for name, (rec, codes) in grids(rot, bits).items():
            err = float((rotate(rec) - rest).pow(2).sum())  # the intact channels add no error
            row["grids"][f"{name} {bits}b"] = {"rel_mse": err / energy, "rel_mse_rest": err / float(rest.pow(2).sum()),
                                              "code_entropy_bits": entropy_bits(codes, bits)}
    return row


def gradient_stats(g: torch.Tensor, tokens_per_microbatch: int) -> dict:
    norms = g.pow(2).sum(1).reshape(-1, tokens_per_microbatch)
    ranked = norms.sort(1, descending=True).values
    share = {f"top_{int(f * 100)}pct_tokens_energy": float(ranked[:, :math.ceil(f * tokens_per_microbatch)].sum()
                                                           / ranked.sum()) for f in (0.1, 0.25, 0.5)}
    rot = rotate(g)
    z = rot / rot.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-30)
    row = {**share, "rotated_excess_kurtosis": kurtosis(z), "grids": {}}
    energy = float(g.pow(2).sum())
    for bits in (1, 2):
        for name, (rec, codes) in grids(rot, bits).items():
            back = rotate(rec)
            row["grids"][f"{name} {bits}b"] = {
                "rel_mse": float((back - g).pow(2).sum()) / energy,
                "cosine": float((back * g).sum() / (back.norm() * g.norm())),
                "norm_ratio": float(back.norm() / g.norm()), "code_entropy_bits": entropy_bits(codes, bits)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--out", default="experiments/frontier/results/diagnose.json")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    xs, gs, calib = capture(args.batches)
    seq = BASE["train.seq_len"]
    result = {"recipe": "frontier (SmolLM2-135M, 4 stages, MATH held-out rows), pretrained weights, dense",
              "batches": args.batches, "tokens": xs[0].shape[0], "boundaries": []}
    for b, (x, g, c) in enumerate(zip(xs, gs, calib)):
        result["boundaries"].append({"boundary": b, "activation": activation_stats(x, c),
                                     "gradient": gradient_stats(g, seq)})
    Path(args.out).write_text(json.dumps({**result, **code_stamp()}, indent=2))
    for r in result["boundaries"]:
        a, g = r["activation"], r["gradient"]
        print(f"boundary {r['boundary']}: outlier energy {a['outlier_energy_share']:.1%}, rotated kurtosis "
              f"{a['rotated_excess_kurtosis']:+.2f}, |z|>3 {a['rotated_tail_beyond_3']:.2%} (Gaussian 0.27%); rest's "
              f"energy in its sequence mean {a['rest_energy_in_sequence_mean']:.1%}, corpus mean "
              f"{a['rest_energy_in_corpus_mean']:.1%}, cosine with the previous token "
              f"{a['rest_cosine_with_previous_token']:.2f}")
        for k, v in a["grids"].items():
            print(f"   fwd {k:<20} rel MSE {v['rel_mse']:.5f} (rest {v['rel_mse_rest']:.4f})  "
                  f"H {v['code_entropy_bits']:.2f} b")
        print(f"   grad: top 10/25/50% tokens hold {g['top_10pct_tokens_energy']:.1%} / "
              f"{g['top_25pct_tokens_energy']:.1%}"
              f" / {g['top_50pct_tokens_energy']:.1%} of the energy; rotated kurtosis "
              f"{g['rotated_excess_kurtosis']:+.2f}")
        for k, v in g["grids"].items():
            print(f"   bwd {k:<20} rel MSE {v['rel_mse']:.4f} cos {v['cosine']:.4f} norm x{v['norm_ratio']:.2f} "
                  f"H {v['code_entropy_bits']:.2f} b")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
