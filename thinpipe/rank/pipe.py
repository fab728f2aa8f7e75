"""What an objective after SFT asks of the pipelines a process drives (``rank/gspo.py``, ``rank/dpo.py``).

One objective step is written once over this interface; the simulation implements it over every replica's
ranks and its mailbox (``engine/sim_pipe.py``), a rank of the real mesh over its own stage and transports
(``engine/dist_pipe.py``), as the SFT step is written once in ``StageRank`` (docs/architecture.md).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from thinpipe.boundary import Boundary
from thinpipe.rank.context import MicrobatchContext, positions_and_mask
from thinpipe.rank.passes import eval_boundary
from thinpipe.rank.schedule import execute
from thinpipe.rank.worker import StageWorker

GENERATE_BATCH = 32  # sequences per generation pass (held-out prompts come in hundreds)


class Pipe(Protocol):
    replicas: list[int]   # the fast replicas whose pipelines this process drives (simulation: all; a rank: its own)
    holds_last: bool      # this process holds those replicas' last stage (it sees their logits)
    lead: bool            # this process writes the run folder (shows progress)
    device: torch.device  # where this process's stages compute (contexts are built there)

    def generate(self, replica: int, prompts: list[list[int]], sampling, boundaries: str,
                 row_keys: torch.Tensor | None, step: int, axis: str | None) -> list[list[int]]:
        """Every stage of ``replica`` samples continuations of ``prompts`` (``rank/generation.py``); each
        process driving the replica gets them. ``boundaries``: ``dense`` or ``train``; bytes metered on ``axis``
        (rollouts: ``rollout``; the held-out measure: None)."""
        ...

    def forward(self, replica: int, ctxs: list[MicrobatchContext], boundaries: str) -> None:
        """Forward passes only (no gradient) of ``ctxs`` through ``replica``'s pipeline, by the training forward
        (``StageWorker.forward``: the same code and numerics): ``train`` boundaries metered on ``pp_fwd``,
        ``eval`` ones (dense unless part of the model) unmetered, or ``reference``: a frozen copy of the starting
        weights on dense boundaries (GSPO's optional KL; kept only when ``rl.kl_beta > 0``). The last stage's
        ``ctx.loss_fn`` records."""
        ...

    def update(self, index: int, lr: float, ctxs: dict[int, list[MicrobatchContext]]) -> float:
        """One optimizer update: every replica's forward and backward of its ``ctxs`` (the schedule over
        ``len(ctxs)`` microbatches), then every phase of ``StageRank`` at update ``index``. Returns the sum over
        this process's replicas of their summed microbatch losses (0 where it holds no last stage)."""
        ...

    def sum_stats(self, values: list[float]) -> list[float]:
        """Element-wise sum over the processes holding a last stage of what each passes (the simulation: its own)."""
        ...


def rollout_rows(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict:
    """Prompt + response rows, right-padded to the longest: labels on the response tokens alone (the next-token
    convention of ``next_token_loss``: label t is predicted at t - 1), segment -1 on padding."""
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    n = len(prompts)
    ids = torch.full((n, length), pad_id, dtype=torch.int64)
    labels = torch.full((n, length), -100, dtype=torch.int64)
    seg = torch.full((n, length), -1, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row = p + r
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        seg[i, :len(row)] = 0
        if r:
            labels[i, len(p):len(row)] = torch.tensor(r, dtype=torch.int64)
    return {"input_ids": ids, "labels": labels, "segment_ids": seg}


def chunk_contexts(batch: dict, rows: int, step: int, replica: int, loss_scale: float,
                   row_keys: torch.Tensor | None = None, device: torch.device | None = None) -> list[MicrobatchContext]:
    """Contexts of ``rows`` consecutive rows each (microbatch m = rows m*rows ..), sharing one loss scale."""
    out = []
    n = batch["input_ids"].shape[0]
    for m, start in enumerate(range(0, n, rows)):
        sl = slice(start, start + rows)
        ids, labels, seg = (batch[k][sl].to(device) if device is not None else batch[k][sl]
                            for k in ("input_ids", "labels", "segment_ids"))
        pos, mask = positions_and_mask(seg)
        keys = row_keys[sl] if row_keys is not None else None
        out.append(MicrobatchContext(step, m, replica, ids, labels, pos, mask, loss_scale, row_keys=keys))
    return out


def forward_order(num_stages: int, microbatches: int, stages: list[int] | None = None) -> list:
    """Forward actions only, microbatch by microbatch, stage by stage (or on ``stages`` alone)."""
    return [(s, ("F", m)) for m in range(microbatches) for s in (stages if stages is not None else range(num_stages))]


def forward_only(order: list, workers: dict, ctxs: list) -> None:
    """Run forward actions without gradients (``StageWorker.forward``: the training forward's code); the
    workers keep nothing for a backward."""
    for i, c in enumerate(ctxs):
        c.microbatch = i
    with torch.no_grad():
        execute(order, workers, ctxs)
    for w in workers.values():
        w.clear_saved()


def trim_padding(batch: dict) -> dict:
    """``batch`` without the columns that are padding in every row (right padding to ``train.seq_len``):
    causal attention makes them irrelevant to the real tokens, and they cost compute and PP bytes."""
    real = (batch["segment_ids"] >= 0).any(0).nonzero()
    width = int(real.max()) + 1 if real.numel() else 1
    return {k: (v[:, :width] if torch.is_tensor(v) and v.dim() == 2 else v) for k, v in batch.items()}


def eval_worker(stage, replica: int, in_b, out_b, transport, compute_dtype: torch.dtype) -> StageWorker:
    """A worker of ``stage`` through what evaluation passes through (``passes.py: eval_boundary``), unmetered."""
    return StageWorker(stage, replica, eval_boundary(in_b) if in_b is not None else None,
                       eval_boundary(out_b) if out_b is not None else None, transport, compute_dtype, axes=(None, None))


def wants_reference(cfg) -> bool:
    """GSPO with a KL to the starting weights keeps a frozen copy of them on every rank."""
    return cfg.train.objective == "gspo" and cfg.rl.kl_beta > 0


def reference_worker(stage, replica: int, in_b, out_b, transport, compute_dtype: torch.dtype) -> StageWorker:
    """A worker of a frozen copy of ``stage`` as it is now (built before any checkpoint loads: the starting
    weights, which a resumed run rebuilds from the same config) on dense boundaries, unmetered."""
    ref = copy.deepcopy(stage)
    for p in ref.parameters():
        p.requires_grad_(False)
    dense = [None if b is None else Boundary(b.index, b.hidden_size) for b in (in_b, out_b)]
    return StageWorker(ref, replica, *dense, transport, compute_dtype, axes=(None, None))
