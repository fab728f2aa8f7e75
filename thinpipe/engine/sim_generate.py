"""Generation on the simulated mesh: every rank of one replica runs its ``rank/generation.py: decode_pass``,
driven in lockstep over the mesh's mailbox (as ``SimMesh.eval_loss`` drives the held-out pass).

``boundaries``: ``dense`` passes through what evaluation passes through (``rank/passes.py:
eval_boundary``: the boundary itself when it is part of the model, dense otherwise), ``train`` through
the replica's own training boundaries (RL rollouts that see what training sees).
"""

from __future__ import annotations

import torch

from thinpipe.comm.inprocess import drive_lockstep
from thinpipe.comm.protocols import Transport
from thinpipe.rank.generation import Sampling, chunks, decode_pass, pad_id_of, pick_boundary


def generate_on_stages(stages: list, bounds: list, transport: Transport, prompts: list[list[int]], sampling: Sampling,
                       tokenizer, *, replica: int = 0, axis: str | None = None, row_keys: torch.Tensor | None = None,
                       step: int = 0, compute_dtype: torch.dtype = torch.float32,
                       batch_size: int | None = 32) -> list[list[int]]:
    """``stages`` (one pipeline, in order) and the ``bounds`` between them, in one process: the generated
    ids per prompt. Batches larger than ``batch_size`` are split; every rank must end with the same ids."""
    sampling.validate()
    pad = pad_id_of(tokenizer, sampling)
    result: list[list[int]] = []
    for i, part in enumerate(chunks(len(prompts), batch_size)):
        outs: list[list] = [[] for _ in stages]
        keys = None if row_keys is None else row_keys[part]
        drive_lockstep(decode_pass(st, bounds[s - 1] if s else None, bounds[s] if s < len(stages) - 1 else None,
                                   transport, prompts[part], sampling, tokenizer, pad, outs[s], replica=replica,
                                   key=i, axis=axis, compute_dtype=compute_dtype, row_keys=keys, step=step,
                                   first_row=part.start)
                       for s, st in enumerate(stages))
        if any(o != outs[-1] for o in outs):
            raise RuntimeError("generation: the stages of one replica disagree on the generated tokens")
        result.extend(outs[-1])
    return result


def generate_on_mesh(mesh, prompts: list[list[int]], sampling: Sampling, tokenizer, *, replica: int = 0,
                     boundaries: str = "dense", axis: str | None = None, row_keys: torch.Tensor | None = None,
                     step: int = 0, batch_size: int | None = 32) -> list[list[int]]:
    """Replica ``replica`` of a ``SimMesh`` generates from ``prompts`` (token ids): per prompt its
    generated ids (EOS included when sampled). Payloads are metered on ``axis`` of ``mesh.meter``
    (None: not metered)."""
    ranks = mesh.ranks[replica]
    bounds = [pick_boundary(rk.out_boundary, boundaries) for rk in ranks[:-1]]
    return generate_on_stages([rk.stage for rk in ranks], bounds, mesh.mailbox, prompts, sampling, tokenizer,
                              replica=replica, axis=axis, row_keys=row_keys, step=step,
                              compute_dtype=mesh.compute_dtype, batch_size=batch_size)
