"""PowerSGD low-rank compression of tensors to be averaged (Vogels et al. 2019, PowerSGD; docs/dp.md).

Math in plain functions, state explicit and keyed by parameter name. One compressed average of a
matrix M (higher-rank tensors viewed as (shape[0], -1); vectors go uncompressed):

    M <- M + E                       error feedback (E starts at 0)
    P  = M Q                         Q (m x r) warm-started, orthonormalised, random at first
    P <- allreduce_sum(P); orthonormalise P
    Q  = M^T P;  Q <- allreduce_mean(Q)
    approx = P Q^T                   the average every worker applies
    E  = M - approx                  local residual, fed back next time

Wire: r (n + m) values per matrix instead of n m. Before ``start_step`` everything is averaged
uncompressed; a matrix is compressed only if it saves at least ``min_compression_rate`` (as
PyTorch's hook does). ``powersgd_average`` is a generator: it yields each collective's ``Work``
so that one process can drive several simulated ranks in lockstep, or a real rank can overlap the
waits; the group is a ``comm/protocols.py: Group`` (``all_reduce(rank, tensor) -> Work``: sum, in place).
``PowerSGD`` is the scheme that averages the gradients so every step (``dp.kind = powersgd``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from thinpipe.comm.protocols import Group
from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.kinds import PowerSGDKind
from thinpipe.dp.scheme import DPScheme


def orthonormalize(P: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormal columns by modified Gram-Schmidt, in place (as PyTorch's hook for small ranks).
    ``eps`` keeps a column that is (numerically) dependent on the previous ones tiny instead of
    blowing rounding noise up to a unit vector: a rank-1 matrix at rank 2 stays exact."""
    for i in range(P.shape[1]):
        col = P[:, i:i + 1]
        col /= torch.linalg.vector_norm(col).clamp(min=eps)
        if i + 1 < P.shape[1]:
            rest = P[:, i + 1:]
            rest -= (col.T @ rest) * col
    return P


def should_compress(n: int, m: int, rank: int, min_rate: float) -> bool:
    return (n + m) * rank * min_rate < n * m


@dataclass
class PowerSGDState:
    rank: int = 4
    start_step: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0
    step: int = 0
    q: dict[str, torch.Tensor] = field(default_factory=dict)
    error: dict[str, torch.Tensor] = field(default_factory=dict)

    def initial_q(self, name: str, m: int, r: int, dtype, device=None) -> torch.Tensor:
        # Same seed on every worker: the Qs must agree for P = M Q to be summable. Drawn on a CPU
        # generator and moved, so a GPU worker starts from the same Q as a CPU one.
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        return torch.randn(m, r, generator=gen, dtype=dtype).to(device)

    def state_dict(self) -> dict:
        return {"step": self.step, "q": dict(self.q), "error": dict(self.error)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.q, self.error = state["step"], dict(state["q"]), dict(state["error"])


def factorized(shapes: dict[str, tuple[int, ...]], state: PowerSGDState) -> dict[str, tuple[int, int, int]]:
    """The tensors ``powersgd_average`` sends as factors, in its order: name -> (n, m, r)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) < 2 or state.step < state.start_step:
            continue
        n, m = shape[0], 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, state.rank)
        if should_compress(n, m, r, state.min_compression_rate):
            out[name] = (n, m, r)
    return out


def wire_numel(shapes: dict[str, tuple[int, ...]], state: PowerSGDState) -> int:
    """Values one worker contributes per average: r(n + m) per compressed matrix, numel otherwise."""
    plan = factorized(shapes, state)
    total = 0
    for name, shape in shapes.items():
        if name in plan:
            n, m, r = plan[name]
            total += r * (n + m)
        else:
            total += math.prod(shape)
    return total


def powersgd_average(state: PowerSGDState, tensors: dict[str, torch.Tensor], group: Group, rank: int,
                     world: int) -> Generator:
    """Replace each tensor in ``tensors`` (in place) by the compressed average over ``group``.
    Yields the Works of its collectives; advances ``state.step`` when done."""
    dense, mats = [], []
    for name, t in tensors.items():
        matrix = t.view(t.shape[0], -1) if t.ndim >= 2 else None
        if matrix is None or state.step < state.start_step:
            dense.append(t)
            continue
        n, m = matrix.shape
        r = min(n, m, state.rank)
        if not should_compress(n, m, r, state.min_compression_rate):
            dense.append(t)
            continue
        mats.append((name, matrix, r))
    if dense:
        yield from allreduce_average({str(i): t for i, t in enumerate(dense)}, group, rank, world)
    if mats:
        for name, M, r in mats:
            if name in state.error:
                M += state.error[name].to(M.device)  # a checkpoint loads state on the CPU
        local = {name: M.clone() for name, M, _ in mats}
        qs = {}
        for name, M, r in mats:
            q = state.q.get(name)
            qs[name] = orthonormalize(q.to(M.device, copy=True) if q is not None
                                      else state.initial_q(name, M.shape[1], r, M.dtype, M.device))
        ps = torch.cat([(M @ qs[name]).reshape(-1) for name, M, _ in mats])
        yield group.all_reduce(rank, ps)          # sum: P is orthonormalised next anyway
        offset, p_of = 0, {}
        for name, M, r in mats:
            P = ps[offset:offset + M.shape[0] * r].view(M.shape[0], r)
            offset += P.numel()
            p_of[name] = orthonormalize(P)
        qflat = torch.cat([(M.T @ p_of[name]).reshape(-1) for name, M, _ in mats])
        yield group.all_reduce(rank, qflat)
        qflat /= world
        offset = 0
        for name, M, r in mats:
            Q = qflat[offset:offset + M.shape[1] * r].view(M.shape[1], r)
            offset += Q.numel()
            M.copy_(p_of[name] @ Q.T)
            state.error[name] = local[name] - M
            state.q[name] = Q.clone()
    state.step += 1


class PowerSGD(PowerSGDKind, DPScheme):
    """``dp.kind = powersgd``: the gradients' low-rank average, every step (rank ``dp.rank``, 4 when 0;
    uncompressed for the first ``dp.start_step`` averages)."""

    def __init__(self, cfg, trained, group, member, seed):
        super().__init__(cfg, trained, group, member, seed)
        self.state = PowerSGDState(rank=cfg.rank or 4, start_step=cfg.start_step, seed=seed)

    def sync_grads(self, step: int, grads: dict[str, torch.Tensor]) -> Generator:
        if self.group.size > 1:
            yield from powersgd_average(self.state, grads, self.group, self.member, self.group.size)

    def state_dict(self) -> dict:
        return {"psgd": self.state.state_dict()}

    def load_state_dict(self, state: dict) -> Generator:
        if state.get("psgd") is not None:
            self.state.load_state_dict(state["psgd"])
        yield from ()
