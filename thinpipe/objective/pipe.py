"""What an objective (``objective/base.py``: SFT, DPO, GSPO) asks of the pipelines a process drives.

Every objective's step is written once over this interface; each engine implements it once: the simulation over
every replica's ranks and its mailbox (``engine/sim_pipe.py``), a rank of the real mesh (and of an elastic
replica) over its own stage and transports (``engine/dist_pipe.py``). An update is the one place a step is put
together per transport: the pipeline schedule, the anchor circuit's pull and priors, the optional gradient
diagnostic (simulation), and every phase of ``StageRank`` (docs/architecture.md).
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch

from thinpipe.boundary import Boundary
from thinpipe.comm.header import PayloadError
from thinpipe.rank.context import MicrobatchContext, positions_and_mask
from thinpipe.rank.passes import eval_boundary
from thinpipe.rank.schedule import execute
from thinpipe.rank.worker import StageWorker

GENERATE_BATCH = 32  # sequences per generation pass (held-out prompts come in hundreds)


@runtime_checkable
class Pipe(Protocol):
    replicas: list[int]   # the fast replicas whose pipelines this process drives (simulation: all; a rank: its own,
    #                       an elastic replica's: its replica of the job), whose data shards it trains on
    holds_last: bool      # this process holds those replicas' last stage (it sees their logits)
    measures: bool        # this process takes part in the held-out measure (replica 0's pipeline; every elastic
    #                       replica measures its own)
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

    def update(self, index: int, lr: float, ctxs: dict[int, list[MicrobatchContext]], source) -> float:
        """One optimizer update: every replica's forward and backward of its ``ctxs`` (the schedule over
        ``len(ctxs)`` microbatches), then every phase of ``StageRank`` at update ``index`` with the anchor priors
        due at it. With an anchor circuit, a cycle that starts at ``index`` runs on the weights this update's
        forward used, on the rows ``source.anchor_rows(index, ctxs)`` gives (``source``: the objective). Returns
        the sum over this process's replicas of their summed microbatch losses (0 where it holds no last stage)."""
        ...

    def heldout(self, batches) -> list[tuple[float, int]]:
        """Replica 0's held-out next-token loss of each batch (sum, tokens), through dense boundaries unless part
        of the model (``rank/passes.py: heldout_pass``); where this process holds no last stage, nothing."""
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
        out.append(MicrobatchContext(step, m, replica, ids, labels, pos, mask, loss_scale, row_keys=keys,
                                     extras={"segment_ids": seg}, share=ids.shape[0] / n))
    return out


ROW_KEYS = ("input_ids", "labels", "segment_ids")


def pack_rows(ctxs: list[MicrobatchContext], per_row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows of ``ctxs`` (contexts of ``chunk_contexts``, one loss scale) as named tensors on the host: what the
    anchor circuit's pass needs of an update of DPO or GSPO (``per_row``: the objective's per-row tensors, first
    dimension the rows'), to rebuild it with ``unpack_rows``; a pull carries them on the real mesh."""
    out = {k: torch.cat([c.input_ids if k == "input_ids" else c.labels if k == "labels" else c.extras[k]
                         for c in ctxs]).cpu() for k in ROW_KEYS}
    # (rows per microbatch, the loss scale's float64 bits): one tensor, as a payload holds at most 8
    # (comm/payload.py) and a pull carries the step and the weights besides
    # float64 never crosses a link as a float (comm/header.py): its bits do, exact on arrival
    scale_bits = torch.tensor([ctxs[0].loss_scale], dtype=torch.float64).view(torch.int64)
    out["layout"] = torch.cat([torch.tensor([ctxs[0].input_ids.shape[0]], dtype=torch.int64), scale_bits])
    return {**out, **{k: v.detach().cpu() for k, v in per_row.items()}}


def unpack_rows(rows: dict[str, torch.Tensor], index: int, tag: int, device, loss_fn) -> list[MicrobatchContext]:
    """``pack_rows``' contexts again, for update ``index`` of replica ``tag`` (the anchor's), ``loss_fn`` their
    loss: every per-row tensor is in each context's ``extras``, sliced to its rows."""
    n, per = rows["input_ids"].shape[0], int(rows["layout"][0])
    batch = {k: rows[k] for k in ROW_KEYS}
    ctxs = chunk_contexts(batch, per, index, tag, float(rows["layout"][1:].view(torch.float64)[0]), device=device)
    extra = [k for k in rows if k not in (*ROW_KEYS, "layout")]
    for c, start in zip(ctxs, range(0, n, per)):
        c.loss_fn = loss_fn
        c.extras.update({k: rows[k][start:start + per].to(device) for k in extra})
    return ctxs


def check_rows(rows: dict[str, torch.Tensor], per_row: tuple[str, ...], max_rows: int, seq_len: int,
               vocab: int) -> None:
    """Refuse rows a peer sent that are not what ``pack_rows`` writes (``comm/header.py`` bounded their bytes
    before they were allocated; this checks their meaning before anything indexes with them)."""
    want = {*ROW_KEYS, "layout", *per_row}
    if set(rows) != want:
        raise PayloadError(f"anchor rows: got {sorted(rows)}, expected {sorted(want)}")
    ids = rows["input_ids"]
    n, t = ids.shape if ids.dim() == 2 else (0, 0)
    layout = rows["layout"]
    per = int(layout[0]) if layout.shape == (2,) and layout.dtype == torch.int64 else 0
    if not (0 < n <= max_rows and 0 < t <= seq_len and 0 < per and n % per == 0 and ids.dtype == torch.int64
            and all(rows[k].shape == ids.shape and rows[k].dtype == torch.int64 for k in ("labels", "segment_ids"))
            and all(rows[k].shape[:1] == (n,) and rows[k].dtype == torch.float32 for k in per_row)
            and int(ids.min()) >= 0 and int(ids.max()) < vocab and int(rows["labels"].max()) < vocab):
        raise PayloadError(f"anchor rows: {n} rows of {t} tokens in microbatches of {per} do not fit this run "
                           f"(at most {max_rows} rows of {seq_len} tokens, token ids below {vocab})")


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


def reference_worker(stage, replica: int, in_b, out_b, transport, compute_dtype: torch.dtype) -> StageWorker:
    """A worker of a frozen copy of ``stage`` as it is now (built before any checkpoint loads: the starting
    weights, which a resumed run rebuilds from the same config) on dense boundaries, unmetered."""
    ref = copy.deepcopy(stage)
    for p in ref.parameters():
        p.requires_grad_(False)
    dense_in, dense_out = [None if b is None else Boundary(b.index, b.hidden_size) for b in (in_b, out_b)]
    return StageWorker(ref, replica, dense_in, dense_out, transport, compute_dtype, axes=(None, None))
