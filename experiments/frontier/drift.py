"""How far the KLT basis drifts as the model trains, and what a refit would buy (issue 36, item 1).

For the pretrained SmolLM2 (step 0) and each given checkpoint of the frontier recipe (exported with
``thinpipe export``), the ``klt`` kind's start is fitted at every boundary on the same 16 training
batches (8,192 tokens, through dense boundaries, as a run's start is). Reported per boundary and
checkpoint:

- the principal angles between the step-0 and the step-t top-k subspaces (k = 32 and 128): the mean
  cos^2 (1 = the same subspace) and the largest angle;
- the forward's MSE relative to the activations' centred energy (all channels) on 2 held-out batches of
  step t's activations, coded at the loss table
  (3 bits/dim) and the context table (1 bit/dim) with the step-0 start (what a run without refresh
  sends) and with step t's own start (what a refresh would send): their ratio is the refresh's gain.

    .venv/bin/python experiments/frontier/drift.py --models /tmp/export60,/tmp/export100 --steps 60,100
    # -> results/drift.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from thinpipe.boundary import KltBoundary
from thinpipe.config import Config, apply_overrides
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.objective.registry import build_data
from thinpipe.provenance import code_stamp
from thinpipe.rank.context import make_contexts
from thinpipe.rank.from_config import load, residual_batches, val_batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ARMS, FRONTIER_BASE  # noqa: E402

ARM = "KLTw 3-1b-1b T75"
PROBE_KEYS = ("model.", "data.", "mesh.pp", "train.batch_size", "train.seq_len", "model.tied")


def residuals(model_name: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Per boundary: (calibration residuals, held-out activations), and the held-out contexts."""
    cfg = Config()
    apply_overrides(cfg, {**{k: v for k, v in FRONTIER_BASE.items() if k.startswith(PROBE_KEYS)},
                          **ARMS[ARM], "model.name": model_name, "boundary.kind": "identity"})
    cfg.validate()
    loaded = load(cfg)
    train_ds, val_ds = build_data(cfg, loaded.tokenizer)
    mesh = SimMesh(loaded.model, cfg)
    calib = residual_batches(copy.deepcopy(cfg), train_ds)
    held = [b for _, b in zip(range(2), val_batches(val_ds, cfg.train.batch_size))]
    ctxs = [make_contexts(b, 1, 0, 0)[0] for b in held]
    return mesh.boundary_residuals(calib), mesh.boundary_residuals(held), ctxs


def fit(res: torch.Tensor, index: int) -> KltBoundary:
    s = ARMS[ARM]
    b = KltBoundary(index, res.shape[1], s["boundary.klt_bits"], s["boundary.klt_context_bits"], 1, 64)
    b.load_init(b.init_from_residuals(res))
    return b


def coded_error(b: KltBoundary, x: torch.Tensor, ctxs: list, table: str) -> float:
    """Relative MSE of ``x`` coded with ``b`` at one table (every token in that class)."""
    num = den = 0.0
    at = 0
    for ctx in ctxs:
        n = ctx.tokens
        xs = x[at:at + n].reshape(*ctx.input_ids.shape, -1)
        at += n
        labels = torch.full_like(ctx.labels, 1 if table == "loss" else -100)
        c = copy.copy(ctx)
        c.labels = labels
        if table == "loss":
            c.labels[:, -1:] = -100  # the last position is never scored; keep it out of both counts
        xh = b.decode(b.encode(xs, c)[1], c)
        # one denominator for every start (the centred energy of all channels, intact ones included), so that
        # two starts with different intact channels compare on the same scale
        num += float((xh - xs).pow(2)[:, :-1].sum())
        den += float((xs - xs.reshape(-1, xs.shape[-1]).mean(0)).pow(2)[:, :-1].sum())
    return num / den


def overlap(u0: torch.Tensor, u1: torch.Tensor, k: int) -> tuple[float, float]:
    cos = torch.linalg.svdvals(u0[:, :k].double().T @ u1[:, :k].double()).clamp(max=1.0)
    return float(cos.pow(2).mean()), float(torch.rad2deg(torch.arccos(cos.min())))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="comma-separated exported checkpoints")
    ap.add_argument("--steps", required=True, help="their steps, comma-separated")
    ap.add_argument("--out", default="experiments/frontier/results/drift.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base_cal, _, _ = residuals(FRONTIER_BASE["model.name"])
    starts = [fit(r, i) for i, r in enumerate(base_cal)]
    rows = []
    for name, step in zip(args.models.split(","), (int(s) for s in args.steps.split(","))):
        cal, held, ctxs = residuals(name)
        for i, (r, x) in enumerate(zip(cal, held)):
            own = fit(r, i)
            row = {"step": step, "boundary": i}
            row["same_channels"] = bool(torch.equal(starts[i].channels, own.channels))
            for k in (32, 128):
                row[f"cos2_top{k}"], row[f"max_angle_deg_top{k}"] = overlap(starts[i].basis.float(), own.basis.float(),
                                                                            k)
            for table in ("loss", "context"):
                old, new = coded_error(starts[i], x, ctxs, table), coded_error(own, x, ctxs, table)
                row[f"rel_mse_{table}_step0_start"], row[f"rel_mse_{table}_refit"] = old, new
                row[f"refit_gain_db_{table}"] = 10 * float(torch.log10(torch.tensor(old / new)))
            rows.append(row)
            print(json.dumps(row))
    Path(args.out).write_text(json.dumps({"arm": ARM, "rows": rows, **code_stamp()}, indent=2))


if __name__ == "__main__":
    main()
