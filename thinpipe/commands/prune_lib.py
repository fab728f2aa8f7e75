"""``thinpipe prune``: post-hoc global magnitude pruning of a trained run, re-evaluated at each
sparsity (anchor-priors §5.5: masked training makes checkpoints more tolerant of pruning).

Global: one ranking over every prunable weight of the model, so layers lose different shares. The
prunable set is every 2-D weight of the decoder layers (attention and MLP projections); embeddings,
the LM head and norms stay dense, as is usual for LLM pruning (they are a small, sensitive share).
Exact: at sparsity s exactly round(s x n) weights become zero, the smallest in magnitude; ties at
the threshold are broken by position, so the count is exact whatever the values.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from torch import nn

from thinpipe.config import ConfigError, apply_overrides
from thinpipe.engine.run_folder import load_run
from thinpipe.engine.sim_engine import mesh_validation_loss
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.eval.loglik import logits_fn_from_model
from thinpipe.eval.multiple_choice import evaluate_mc
from thinpipe.objective.registry import build_data


def prunable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every 2-D weight inside the decoder layers."""
    return [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in f".{n}"]


@torch.no_grad()
def global_magnitude_prune(model: nn.Module, sparsity: float) -> dict:
    """Zero exactly round(sparsity x n) of the prunable weights, smallest |w| first; in place."""
    if not 0 <= sparsity < 1:
        raise ConfigError(f"sparsity must be in [0, 1), got {sparsity}")
    weights = prunable(model)
    if not weights:
        raise ConfigError("the model has no decoder-layer weight matrices to prune")
    sizes = [p.numel() for _, p in weights]
    total = sum(sizes)
    k = int(round(sparsity * total))
    if k:
        flat = torch.cat([p.detach().abs().reshape(-1).float() for _, p in weights])
        threshold = flat.kthvalue(k).values
        below = flat < threshold
        ties = (flat == threshold).nonzero().squeeze(1)
        drop = below.clone()
        drop[ties[:k - int(below.sum())]] = True
        for (_, p), m in zip(weights, drop.split(sizes)):
            p.masked_fill_(m.view_as(p), 0.0)
    zeros = sum(int((p == 0).sum()) for _, p in weights)
    return {"sparsity": sparsity, "pruned": k, "prunable": total, "zeros": zeros}


def parse_sparsities(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--sparsity takes comma-separated fractions, e.g. 0.1,0.2,0.3; got {text!r}") from None
    if not values or any(not 0 <= v < 1 for v in values):
        raise ConfigError(f"--sparsity values must be fractions in [0, 1), got {text!r}")
    return values


def prune_sweep(run: str | Path | list, sparsities: list[float], tasks: list[str], limit: int | None,
                out: Path | None = None, device: str = "cpu") -> dict:
    """Held-out loss (and MC accuracy on ``tasks``) of ``run``'s model at each sparsity (a run of any engine; a
    dist job's machines' folders, a list: written into the first unless ``out``)."""
    from tqdm import tqdm


    cfg, model, tokenizer = load_run(run, device)
    dev = next(model.parameters()).device
    model.eval()
    _, val = build_data(cfg, tokenizer)
    # the pruned model is evaluated whole: one stage, a dense boundary, the run's data and batch
    eval_cfg = apply_overrides(copy.deepcopy(cfg), {"mesh.pp": 1, "mesh.dp": 1, "mesh.anchor": 0,
                                                    "boundary.kind": "identity", "dp.kind": "allreduce"})
    rows = []
    for s in tqdm(sparsities, desc="prune", unit="sparsity"):
        pruned = copy.deepcopy(model)
        stats = global_magnitude_prune(pruned, s)
        loss = mesh_validation_loss(SimMesh(pruned, eval_cfg, dev), val, cfg.train.batch_size)
        row = {**stats, "val_loss": loss, "val_ppl": math.exp(loss)}
        with torch.no_grad():
            for t in tasks:
                r = evaluate_mc(logits_fn_from_model(pruned), tokenizer, t, limit=limit)
                row[f"{t}_acc"], row[f"{t}_acc_norm"] = r["acc"], r["acc_norm"]
        rows.append(row)
    first = Path(run[0] if isinstance(run, list) else run)
    result = {"run": [str(r) for r in run] if isinstance(run, list) else str(run), "rows": rows}
    out = Path(out) if out else first / "prune"
    out.mkdir(parents=True, exist_ok=True)
    (out / "prune.json").write_text(json.dumps(result, indent=2))
    plot_sweep({first.name: rows}, out / "prune.png")
    return result


def plot_sweep(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, rows in curves.items():
        ax.plot([r["sparsity"] for r in rows], [r["val_loss"] for r in rows], marker="o", label=name)
    ax.set_xlabel("global magnitude sparsity (decoder matrices)")
    ax.set_ylabel("held-out loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
