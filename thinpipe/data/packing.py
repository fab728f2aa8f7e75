"""Best-fit-decreasing packing of tokenized chat examples into fixed-length rows.

The paper packs with best-fit-decreasing (BFD) for its long-context tasks (App. I.3). BFD sorts
documents longest first and puts each into the row whose free space fits it most tightly, opening a
new row only when none fits. Unlike concatenate-and-chop packing, a document is never split across
rows, so every row holds whole ChatML exchanges and no response is trained without its prompt.
Fixed-length rows keep every pipeline payload the same shape, which the PP boundaries rely on.

Row layout (one row of seq_len positions):

    input_ids    [doc0 ........][doc1 .....][doc2 ..][pad pad pad]
    labels       token id where the chat mask is True (response), else -100; pad -> -100
    segment_ids  0 0 0 0 0 0 0 0 1 1 1 1 1 1 2 2 2 2 -1 -1 -1

Labels are not shifted: the model compares logits[:, :-1] with labels[:, 1:]. Each document starts
with a prompt token (label -100), so no target is ever predicted across a document boundary.
segment_ids let the model keep attention (and positions) inside a document.

Truncation: an example longer than seq_len is cut to its first seq_len tokens and fills a row on its
own (counted in stats["num_truncated"]). If truncation leaves it without any response token it is
dropped (stats["num_dropped_no_loss"]): a row with no loss token would make a per-batch mean loss
0/0 when it is alone in a batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100  # label of positions without loss (torch.nn.functional.cross_entropy default)
PAD_SEGMENT = -1


@dataclass
class PackedDataset:
    """Fixed-length training rows; row i is (input_ids[i], labels[i], segment_ids[i])."""

    input_ids: torch.Tensor  # (N, seq_len) int64 (int32, memory-mapped, for a user's files: rows() widens)
    labels: torch.Tensor  # (N, seq_len); input_ids where loss counts, else -100
    segment_ids: torch.Tensor  # (N, seq_len); document index within the row, -1 = padding
    stats: dict = field(default_factory=dict)  # counts from packing (examples, truncated, fill, ...)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __getitem__(self, i) -> dict[str, torch.Tensor]:
        return self.rows(i)

    def rows(self, i) -> dict[str, torch.Tensor]:
        """Rows ``i`` (an index, slice or index tensor) as int64 tensors (a user's cached data is int32 on disk)."""
        return {"input_ids": self.input_ids[i].long(), "labels": self.labels[i].long(),
                "segment_ids": self.segment_ids[i].long()}


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, in placement order) of a BFD packing; every length <= capacity.

    Ties are broken by index, so the result is a pure function of the input. Free space is kept as
    a sorted list of (free, bin) pairs, so each placement is one binary search: O(n log n) compares.
    """
    if any(n > capacity or n <= 0 for n in lengths):
        raise ValueError(f"every length must be in 1..{capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index) of bins that are not full, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))  # tightest bin with free >= n
        if pos < len(free):
            room, b = free.pop(pos)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def pack(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int, pad_token_id: int,
         generator: torch.Generator | None = None) -> PackedDataset:
    """Pack (ids, loss_mask) examples into rows of seq_len by BFD; rows shuffled with `generator`."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    docs: list[tuple[list[int], list[bool]]] = []
    n_trunc = n_dropped = 0
    for ids, mask in examples:
        if len(ids) != len(mask):
            raise ValueError("ids and loss mask differ in length")
        if len(ids) > seq_len:
            ids, mask = ids[:seq_len], mask[:seq_len]
            n_trunc += 1
        if not any(mask):
            n_dropped += 1
            continue
        docs.append((list(ids), list(mask)))
    bins = best_fit_decreasing([len(d[0]) for d in docs], seq_len)
    order = torch.randperm(len(bins), generator=generator).tolist() if bins else []

    input_ids = torch.full((len(bins), seq_len), pad_token_id, dtype=torch.long)
    labels = torch.full((len(bins), seq_len), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.full((len(bins), seq_len), PAD_SEGMENT, dtype=torch.long)
    for row, b in enumerate(order):
        t = 0
        for seg, i in enumerate(bins[b]):
            ids, mask = docs[i]
            ids_t = torch.tensor(ids, dtype=torch.long)
            input_ids[row, t:t + len(ids)] = ids_t
            labels[row, t:t + len(ids)] = torch.where(torch.tensor(mask), ids_t, IGNORE_INDEX)
            segment_ids[row, t:t + len(ids)] = seg
            t += len(ids)

    n_tokens = sum(len(d[0]) for d in docs)
    stats = {
        "num_examples": len(examples), "num_packed": len(docs), "num_truncated": n_trunc,
        "num_dropped_no_loss": n_dropped, "num_rows": len(bins), "num_tokens": n_tokens,
        "num_loss_tokens": int((labels != IGNORE_INDEX).sum()),
        "fill": n_tokens / (len(bins) * seq_len) if bins else 0.0,
    }
    return PackedDataset(input_ids, labels, segment_ids, stats)


def position_ids_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document start (padding counts on from its own start).

    segment_ids: (B, T) -> (B, T) int64. For models that should see each packed document as if it
    were alone (RoPE positions per document).
    """
    T = segment_ids.shape[-1]
    t = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    start_of_current = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=-1).values
    return t - start_of_current
