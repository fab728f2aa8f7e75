"""What the anchor circuit computes the same way in one process and as processes (``sim_circuit.py``,
``dist_rank.py``): its unmasked pass and the staleness keys of a run's summary (anchor-priors §3, App. H)."""

from __future__ import annotations

import torch

from thinpipe.rank.context import MicrobatchContext
from thinpipe.rank.schedule import execute
from thinpipe.rank.worker import StageWorker


@torch.enable_grad()
def run_anchor_pass(workers: list[StageWorker], order, ctxs: list[MicrobatchContext]) -> list[dict[str, torch.Tensor]]:
    """The unmasked forward-backward of ``ctxs`` (on the stages' device) through the stages in ``workers`` (one
    process: all of a replica's stages; a real anchor rank: its own), actions in ``order`` as (stage, (kind,
    microbatch)) pairs; returns each stage's gradient (local name -> tensor) and clears it."""
    execute(order, {w.stage.index: w for w in workers}, ctxs)
    grads = []
    for w in workers:
        grads.append({n: p.grad.detach().clone() for n, p in w.stage.named_parameters() if p.grad is not None})
        w.stage.zero_grad(set_to_none=True)
    return grads


def staleness_stats(seen: list[int]) -> dict:
    """The anchor keys of a run's summary that both engines compute alike."""
    return {"priors_consumed": len(seen), "anchor_staleness_mean": sum(seen) / len(seen) if seen else None,
            "anchor_staleness_max": max(seen) if seen else None}
