"""Residual multi-codebook VQ with streaming codebook synchronisation (MAPL §3.5, App. E.4, F).

A projected vector u (r dims, per token) is cut into r/g groups of g = ``group_size`` dims; each
group is quantised by R rounds of residual VQ, round k with its own K-code codebook per group::

    codebooks C: (R, G, K, g)        codes: (N, R, G) integers < K (uint8 for K <= 256)
    q = sum_k C[k, group, code[:, k, group]]

So a token costs R * G code bytes (R * r / g; with g = 2, R = 2: r bytes, half of bf16's 2r).

Codebooks learn by exponential-moving-average k-means (VQ-VAE EMA): the sender keeps a ``live``
codebook updated from every microbatch it encodes. Encoding and decoding use a ``shared``
codebook, of which sender and receiver each hold a copy. Per microbatch the sender copies a chunk of
``sync_codes`` codes (the same code slots in every round and group) from live into its shared copy
and sends that slice with the codes; the receiver writes it into its copy before decoding. Chunks
follow a seeded permutation of the K slots, cycled, so both ends know which slots a slice fills
without sending indices. Both shared copies are therefore identical after every sync, and the
sender quantises with exactly the codebook the receiver decodes with (tests/unit/boundary/test_vq.py).
"""

from __future__ import annotations

import torch
from torch import nn


def split_groups(u: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, r) -> (N, G, g)."""
    return u.reshape(u.shape[0], -1, group_size)


def rvq_encode(u: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """u: (N, G, g) -> codes (N, R, G) int64, greedy residual nearest-code per round."""
    residual = u
    codes = []
    for C in codebooks:                                   # C: (G, K, g)
        d = torch.cdist(residual.transpose(0, 1), C)      # (G, N, K)
        idx = d.argmin(-1).T                              # (N, G)
        codes.append(idx)
        residual = residual - torch.gather(C.unsqueeze(0).expand(u.shape[0], -1, -1, -1), 2,
                                           idx[:, :, None, None].expand(-1, -1, 1, C.shape[-1])).squeeze(2)
    return torch.stack(codes, 1)


def rvq_decode(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """codes (N, R, G) -> (N, G, g): the sum over rounds of the chosen codes."""
    R, G, K, g = codebooks.shape
    flat = codebooks.reshape(R * G, K, g)
    rows = (torch.arange(R, device=codes.device)[:, None] * G
            + torch.arange(G, device=codes.device)[None, :]).reshape(-1)   # (R*G,)
    picked = flat[rows[None, :], codes.reshape(codes.shape[0], -1).long()]         # (N, R*G, g)
    return picked.reshape(codes.shape[0], R, G, g).sum(1)


def ema_update(live: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor, u: torch.Tensor, decay: float) -> None:
    """One EMA k-means step of every round's codebooks on the vectors u (N, G, g), in place.

    counts (R, G, K) and sums (R, G, K, g) are the running assignment statistics; codes never
    chosen keep their value."""
    residual = u
    for k in range(live.shape[0]):
        idx = torch.cdist(residual.transpose(0, 1), live[k]).argmin(-1)          # (G, N)
        onehot = torch.zeros(idx.shape[0], idx.shape[1], live.shape[2], dtype=u.dtype, device=u.device)
        onehot.scatter_(2, idx.unsqueeze(-1), 1.0)                                # (G, N, K)
        counts[k].mul_(decay).add_(onehot.sum(1), alpha=1 - decay)
        sums[k].mul_(decay).add_(torch.einsum("gnk,ngd->gkd", onehot, residual), alpha=1 - decay)
        used = counts[k] > 1e-6
        live[k][used] = sums[k][used] / counts[k][used].unsqueeze(-1)
        chosen = torch.gather(live[k].unsqueeze(0).expand(u.shape[0], -1, -1, -1), 2,
                              idx.T[:, :, None, None].expand(-1, -1, 1, live.shape[-1])).squeeze(2)
        residual = residual - chosen


class StreamingCodebook(nn.Module):
    """One direction's codebooks: live (sender), the sender's shared copy, the receiver's shared copy.

    In a real mesh the receiver's copy lives in the other process; keeping it separate here lets
    the tests check the protocol keeps the two copies equal."""

    DECODER_STATE = ("receiver_shared", "received")  # what the decoding end updates; the encoding end the rest

    # the buffers (registered in __init__), typed for the checker
    live: torch.Tensor
    sender_shared: torch.Tensor
    receiver_shared: torch.Tensor
    counts: torch.Tensor
    sums: torch.Tensor
    order: torch.Tensor
    sent: torch.Tensor
    received: torch.Tensor

    def __init__(self, rank: int, group_size: int, codes: int, rounds: int, sync_codes: int, decay: float,
                 seed: int):
        super().__init__()
        if rank % group_size:
            raise ValueError(f"boundary.rank = {rank} must be a multiple of boundary.mapl-vq.group_size = {group_size}")
        gen = torch.Generator().manual_seed(seed)
        G = rank // group_size
        # Inputs are normalised to unit RMS per token; later rounds quantise ever smaller residuals.
        init = torch.stack([torch.randn(G, codes, group_size, generator=gen) * 0.1 ** k for k in range(rounds)])
        self.register_buffer("live", init.clone())
        self.register_buffer("sender_shared", init.clone())
        self.register_buffer("receiver_shared", init.clone())
        self.register_buffer("counts", torch.zeros(rounds, G, codes))
        self.register_buffer("sums", torch.zeros(rounds, G, codes, group_size))
        self.register_buffer("order", torch.randperm(codes, generator=gen))
        self.register_buffer("sent", torch.zeros((), dtype=torch.int64))      # slices the sender sent
        self.register_buffer("received", torch.zeros((), dtype=torch.int64))  # slices the receiver applied
        self.group_size, self.sync_codes, self.decay = group_size, sync_codes, decay

    def _slots(self, n: int) -> torch.Tensor:
        K = self.order.numel()
        start = (n * self.sync_codes) % K
        return self.order[(start + torch.arange(self.sync_codes, device=self.order.device)) % K]

    @torch.no_grad()
    def sender_encode(self, u: torch.Tensor, learn: bool, sync: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """u (N, r) at unit RMS -> (codes (N, R, G), the slice (R, G, sync_codes, g) to send, or None
        when not syncing)."""
        groups = split_groups(u.float(), self.group_size)
        if learn:
            ema_update(self.live, self.counts, self.sums, groups, self.decay)
        slice_ = None
        if sync:
            slots = self._slots(int(self.sent))
            self.sender_shared[:, :, slots] = self.live[:, :, slots]
            self.sent += 1
            slice_ = self.sender_shared[:, :, slots].clone()
        return rvq_encode(groups, self.sender_shared), slice_

    @torch.no_grad()
    def receiver_decode(self, codes: torch.Tensor, slice_: torch.Tensor | None) -> torch.Tensor:
        """Apply the slice (if any) to the receiver's copy, then decode: (N, r)."""
        if slice_ is not None:
            slots = self._slots(int(self.received))
            self.receiver_shared[:, :, slots] = slice_.to(self.receiver_shared.dtype)
            self.received += 1
        out = rvq_decode(codes, self.receiver_shared)
        return out.reshape(out.shape[0], -1)


def code_dtype(codes: int) -> torch.dtype:
    return torch.uint8 if codes <= 256 else torch.int16 if codes <= 2 ** 15 else torch.int32
