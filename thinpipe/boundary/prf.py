"""Counter-based pseudorandom function for masks that are regenerated, never sent (§3.1).

``keep_indices(key, tokens, H, K)`` is a pure function of its integer arguments: every process,
on CPU or GPU, derives the same kept dims for the same (seed, boundary, step, microbatch) key. A
32-bit integer hash (the "lowbias32" finaliser) of (key, token, dim) gives each coordinate a score;
each token keeps the K dims with the highest scores, so exactly K per token, uniformly over the
H-choose-K subsets. All arithmetic is int64 masked to 32 bits, which wraps identically everywhere.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def prf_key(*parts: int) -> int:
    """Fold integers (seed, boundary, step, microbatch, ...) into one 32-bit key."""
    h = 0x9E3779B9
    for p in parts:
        h = _mix32_int(h ^ _mix32_int((int(p) & _M32) + 0x9E3779B9 + len(parts)))
    return h


def prf_scores(key: int, tokens: int, hidden: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(tokens, hidden) int64 pseudorandom scores, distinct within each row."""
    t = torch.arange(tokens, dtype=torch.int64, device=device).unsqueeze(1)
    d = torch.arange(hidden, dtype=torch.int64, device=device).unsqueeze(0)
    h = _mix32(_mix32(t * 0x27D4EB2F + key) ^ (d * 0x165667B1 & _M32))
    # The dim index in the low bits makes scores unique per row, so top-k has no ties.
    return h * hidden + d


def keep_indices(key: int, tokens: int, hidden: int, keep: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(tokens, keep) sorted int64 indices of the kept dims of each token."""
    scores = prf_scores(key, tokens, hidden, device)
    idx = torch.topk(scores, keep, dim=1, sorted=False).indices
    return idx.sort(dim=1).values


def keep_indices_rows(keys: list[int], positions: torch.Tensor, hidden: int, keep: int) -> torch.Tensor:
    """(B, T, keep) sorted kept dims where row b's token at column t draws from (``keys[b]``, its position
    ``positions[b, t]``) alone: a sequence gets the same masks in whatever batch, microbatch or column it
    sits (the old-log-prob and the update forwards of RL, rollouts left-padded or not)."""
    device = positions.device
    k = torch.tensor([int(x) & _M32 for x in keys], dtype=torch.int64, device=device).view(-1, 1, 1)
    t = positions.to(torch.int64).unsqueeze(-1)
    d = torch.arange(hidden, dtype=torch.int64, device=device).view(1, 1, -1)
    h = _mix32(_mix32(t * 0x27D4EB2F + k) ^ (d * 0x165667B1 & _M32))
    idx = torch.topk(h * hidden + d, keep, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values
