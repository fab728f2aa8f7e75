"""Generation on the real mesh: a fast rank runs its own ``rank/generation.py: decode_pass`` for its replica,
the other ranks of the replica theirs (the simulation drives the same passes in lockstep:
``engine/sim_generate.py``), so every rank of the replica returns the same ids.

Unmetered (``axis`` None) it talks over the engine's evaluation transport, as the held-out pass; with a
metering axis over the training transport, whose meter the run's byte totals read.
"""

from __future__ import annotations

import torch

from thinpipe.rank.generation import Sampling, chunks, decode_pass, pad_id_of, pick_boundary


def generate_on_rank(engine, prompts: list[list[int]], sampling: Sampling, tokenizer, *, boundaries: str = "dense",
                     axis: str | None = None, row_keys: torch.Tensor | None = None, step: int = 0,
                     batch_size: int | None = 32) -> list[list[int]]:
    """This rank's part of its replica's generation from ``prompts`` (token ids, the same on every rank
    of the replica): per prompt the generated ids (EOS included when sampled)."""
    sampling.validate()
    in_b, out_b = pick_boundary(engine.in_b, boundaries), pick_boundary(engine.out_b, boundaries)
    transport = engine.eval_transport if axis is None else engine.transport
    pad = pad_id_of(tokenizer, sampling)
    result: list[list[int]] = []
    for i, part in enumerate(chunks(len(prompts), batch_size)):
        out: list = []
        for _ in decode_pass(engine.stage, in_b, out_b, transport, prompts[part], sampling, tokenizer, pad, out,
                             replica=engine.role.replica, key=i, axis=axis,
                             compute_dtype=engine.rk.worker.compute_dtype,
                             row_keys=None if row_keys is None else row_keys[part], step=step,
                             first_row=part.start):
            pass
        result.extend(out)
    return result
