"""Per-microbatch context every stage derives locally from the (deterministic, shared) data batch.

Each stage's worker reads the same batch, so ids, labels, positions and the attention mask never
cross a boundary; only activations and their gradients do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from thinpipe.data.packing import position_ids_from_segments
from thinpipe.models.packed_attention import Documents


@dataclass
class MicrobatchContext:
    step: int
    microbatch: int
    replica: int
    input_ids: torch.Tensor      # (B, T) int64
    labels: torch.Tensor         # (B, T) int64, -100 = no loss
    position_ids: torch.Tensor   # (B, T) position within the packed document
    attn_mask: Documents | torch.Tensor  # packed documents' spans (models/packed_attention.py), or a (B, 1, T, kv)
    #                                      bool mask, True = may attend (KV-cached generation)
    loss_scale: float            # 1 / loss tokens in the whole step (so microbatch losses sum to the mean)
    # An objective's own loss (thinpipe/objective/): the last stage's loss of (logits, ctx) instead of the
    # next-token loss, the per-row tensors it reads (advantages, old or reference log-probs) and what it
    # reports (sums the engine turns into metrics). None / empty: the next-token loss.
    loss_fn: Callable | None = None
    extras: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    # (B,) int64 PRF keys of the rows: a random boundary then draws each row's masks from (its key, token
    # position) alone, so a sequence gets the same masks in whatever microbatch it lands (RL's old-log-prob and
    # update forwards). None: the key of (step, microbatch, replica) and the flat token index (the next-token loss).
    row_keys: torch.Tensor | None = None
    # This microbatch's share of its step: a per-step mean that is not the loss's own normaliser (a mixture of experts'
    # router loss, models/router_loss.py) weighs it by this; the shares of a step's microbatches sum to 1.
    share: float = 1.0

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def positions_and_mask(segment_ids: torch.Tensor) -> tuple[torch.Tensor, Documents]:
    """Positions restarting per packed document, and block-diagonal causal attention over the documents as their
    spans (no T x T mask: ``models/packed_attention.py``; padding, segment -1, is a run of its own that attends
    causally among itself, its labels -100)."""
    return position_ids_from_segments(segment_ids), Documents.from_segments(segment_ids)


def make_contexts(batch: dict, microbatches: int, step: int, replica: int) -> list[MicrobatchContext]:
    """Split a replica's batch into microbatch contexts sharing one loss normaliser."""
    n_loss = int((batch["labels"][:, 1:] != -100).sum())
    scale = 1.0 / max(n_loss, 1)
    out = []
    for m, (ids, labels, seg) in enumerate(zip(batch["input_ids"].chunk(microbatches),
                                               batch["labels"].chunk(microbatches),
                                               batch["segment_ids"].chunk(microbatches))):
        pos, mask = positions_and_mask(seg)
        out.append(MicrobatchContext(step, m, replica, ids, labels, pos, mask, scale,
                                     share=int((labels[:, 1:] != -100).sum()) * scale if n_loss else 1 / microbatches))
    return out
