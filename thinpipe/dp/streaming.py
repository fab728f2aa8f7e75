"""Streaming DiLoCo (Douillard et al. 2025, Streaming DiLoCo; docs/dp.md): DiLoCo with fragments, overlap and mixing.

- **Fragments**: a stage's parameters are split into F fragments strided over layers (layer k goes
  to fragment k mod F; parameters outside the decoder layers go to fragment 0). Fragment f has its
  outer step every H inner steps, staggered by f H / F steps, so ~1/F of the weights move at a time.
- **Overlap**: a fragment's pseudo-gradient is taken and its all-reduce posted at step t_s; the
  replicas keep training, and the result is applied at t_s + tau (``dp.overlap``).
- **Mixing**: on arrival, local <- alpha local + (1 - alpha) global_new (``dp.alpha``; alpha = 0
  discards the tau local steps, alpha = 1 keeps the local weights and only moves the global copy).
- **Quantised outer gradients** (``dp.quantize``): int8 with one fp32 scale per row, exchanged by
  all-gather (a sum cannot be taken in int8) and averaged after dequantisation.

The outer step itself is ``diloco``'s: Nesterov SGD on the averaged pseudo-gradient, global copy
kept per replica (identical across replicas). ``StreamingDiLoCo`` is the scheme (``dp.kind =
streaming-diloco``): it keeps the posted fragment syncs, saves them as their inputs and posts them again
on load or when an elastic DP group is rebuilt.
"""

from __future__ import annotations

import re
from collections.abc import Generator

import torch

from thinpipe.comm.protocols import Group
from thinpipe.comm.work import DONE
from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.diloco import DiLoCoState, pseudo_gradient
from thinpipe.dp.kinds import StreamingDiLoCoKind
from thinpipe.dp.powersgd import PowerSGDState, powersgd_average
from thinpipe.dp.scheme import DPScheme

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragment_of(name: str, fragments: int) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) % fragments if m else 0


def sync_start_steps(step: int, inner_steps: int, fragments: int) -> list[int]:
    """Fragments whose outer sync starts after inner step ``step`` (0-based): fragment f at steps
    with (step + 1 + f H / F) % H == 0."""
    offset = inner_steps / fragments
    return [f for f in range(fragments) if (step + 1 + round(f * offset)) % inner_steps == 0]


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 per-row scales (rows = first dim; vectors are one row)."""
    rows = t.reshape(t.shape[0], -1) if t.ndim > 1 else t.reshape(1, -1)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127.0
    q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    return (q.to(torch.float32) * scale).reshape(shape)


def quantized_average(tensors: dict[str, torch.Tensor], group: Group, rank: int, world: int) -> Generator:
    """Average by all-gathering int8 values + row scales; every member dequantises all and averages
    in rank order, so all hold the same result."""
    packed = {n: quantize_rows(t) for n, t in tensors.items()}
    qs = torch.cat([q.reshape(-1) for q, _ in packed.values()])
    ss = torch.cat([s.reshape(-1) for _, s in packed.values()])
    # One message: the int8 values followed by the fp32 scales' bytes.
    work, gathered = group.all_gather(rank, torch.cat([qs, ss.view(torch.int8)]))
    yield work
    for t in tensors.values():
        t.zero_()
    for msg in gathered:
        all_q, all_s = msg[:qs.numel()], msg[qs.numel():].view(torch.float32)
        qo = so = 0
        for n, t in tensors.items():
            q, s = packed[n]
            t += dequantize_rows(all_q[qo:qo + q.numel()].view_as(q), all_s[so:so + s.numel()].view_as(s), t.shape)
            qo, so = qo + q.numel(), so + s.numel()
    for t in tensors.values():
        t /= world


class StreamingState(DiLoCoState):
    def __init__(self, named_params, fragments: int, outer_lr: float = 0.7, momentum: float = 0.9):
        named_params = list(named_params)
        super().__init__(named_params, outer_lr, momentum)
        self.fragments = fragments
        self.members = {f: [n for n, _ in named_params if fragment_of(n, fragments) == f] for f in range(fragments)}


def fragment_deltas(state: StreamingState, fragment: int, named_local) -> dict[str, torch.Tensor]:
    """The fragment's pseudo-gradients global - local, taken when its sync starts."""
    local = dict(named_local)
    return {n: pseudo_gradient(state.global_params[n], local[n]) for n in state.members[fragment]}


def fragment_sync(state: StreamingState, fragment: int, deltas: dict[str, torch.Tensor], named_local,
                  group: Group, rank: int, world: int, alpha: float, quantize: bool = False,
                  compressor: PowerSGDState | None = None) -> Generator:
    """Average ``deltas`` (the first yield is the posted collective); when resumed, possibly tau
    inner steps later, apply the fragment's outer step and mix the (by then newer) local weights."""
    local = dict(named_local)
    names = state.members[fragment]
    posted = False
    if compressor is not None:
        averaging = powersgd_average(compressor, deltas, group, rank, world)
    elif quantize:
        averaging = quantized_average(deltas, group, rank, world)
    else:
        averaging = allreduce_average(deltas, group, rank, world)
    for work in averaging:
        posted = True
        yield work
    if not posted:  # a group of one: still a point where the caller can defer the outer step
        yield DONE
    for n in names:
        state.global_params[n].grad = deltas[n]
    # Only this fragment's parameters have a grad, so the outer SGD moves (and keeps momentum for) them alone.
    state.outer.step()
    for n in names:
        state.global_params[n].grad = None
    with torch.no_grad():
        for n in names:
            local[n].mul_(alpha).add_(state.global_params[n].to(local[n].device), alpha=1.0 - alpha)


class StreamingDiLoCo(StreamingDiLoCoKind, DPScheme):
    """``dp.kind = streaming-diloco``: each fragment's outer step every ``dp.inner_steps`` steps, staggered,
    applied ``dp.overlap`` steps after it is posted; local weights mixed with ``dp.alpha``."""

    def __init__(self, cfg, trained, group, member, seed) -> None:
        super().__init__(cfg, trained, group, member, seed)
        self.state = StreamingState(trained(), cfg.fragments, cfg.outer_lr, cfg.outer_momentum)
        self.compressor = (PowerSGDState(rank=cfg.rank, start_step=0, seed=seed)
                           if cfg.rank > 0 and not cfg.quantize else None)
        # posted fragment syncs: (apply step, fragment, deltas, generator, its posted Work)
        self.in_flight: list[tuple[int, int, dict, Generator, object]] = []

    def after_step(self, step: int) -> Generator:
        d = self.cfg
        for f in sync_start_steps(step, d.inner_steps, d.fragments):
            deltas = fragment_deltas(self.state, f, self.trained())
            yield from self._post(step + d.overlap, f, deltas)
        due = [x for x in self.in_flight if x[0] <= step]
        self.in_flight = [x for x in self.in_flight if x[0] > step]
        for _, _, _, gen, work in due:
            yield work
            yield from gen

    def _post(self, due: int, f: int, deltas: dict) -> Generator:
        """Post a fragment's sync now (its first collective); it is finished at step ``due``."""
        d = self.cfg
        gen = fragment_sync(self.state, f, deltas, self.trained(), self.group, self.member, self.group.size,
                            d.alpha, d.quantize, self.compressor)
        try:
            work = next(gen)
        except StopIteration:
            return
        self.in_flight.append((due, f, deltas, gen, work))
        yield DONE  # let the other members post the same collective before anyone posts the next

    def agree_after(self, step: int) -> bool:
        return False  # mixing keeps each replica's local weights its own (only the global copies agree)

    def synchronised(self) -> dict[str, torch.Tensor]:
        """The global copies: each fragment's weights after its last outer step, alike on every replica."""
        return {n: p.detach() for n, p in self.state.global_params.items()}

    def state_dict(self) -> dict:
        return {"psgd": self.compressor.state_dict() if self.compressor else None,
                "streaming": self.state.state_dict(),
                # a posted sync is saved as its inputs (the collective is re-posted on load)
                "in_flight": [(due, f, deltas) for due, f, deltas, _, _ in self.in_flight]}

    def load_state_dict(self, state: dict) -> Generator:
        if self.compressor is not None and state.get("psgd") is not None:
            self.compressor.load_state_dict(state["psgd"])
        if state.get("streaming") is not None:
            self.state.load_state_dict(state["streaming"])
        self.in_flight = []
        for due, f, deltas in state.get("in_flight", []):
            yield from self._post(due, f, deltas)

    def repost(self) -> Generator:
        pending = [(due, f, deltas) for due, f, deltas, _, _ in self.in_flight]
        self.in_flight = []
        for due, f, deltas in pending:
            yield from self._post(due, f, deltas)
