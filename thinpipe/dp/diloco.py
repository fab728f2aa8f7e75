"""DiLoCo outer step (Douillard et al. 2023, DiLoCo; docs/dp.md), math + explicit state.

Each replica runs H inner steps of its inner optimizer on its own data from the shared global
weights theta. Then, per replica (all hold identical global copies and outer-optimizer states):

    delta   = theta_global - theta_local      pseudo-gradient: a positive outer step moves toward local
    delta  <- average over the DP group       the only communication (optionally PowerSGD-compressed)
    theta_global <- OuterSGD(theta_global, grad = delta)   Nesterov, lr 0.7, momentum 0.9 by default
    theta_local  <- theta_global

The global copy lives on the CPU by default (it is touched once per H steps). ``outer_step`` is a
generator yielding the Works of its collectives (see ``powersgd_average``), so the simulation can
drive several replicas in lockstep and a real rank can overlap the wait with compute. ``DiLoCo`` is
the scheme (``dp.kind = diloco``).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from thinpipe.comm.protocols import Group
from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.kinds import DiLoCoKind
from thinpipe.dp.powersgd import PowerSGDState, powersgd_average
from thinpipe.dp.scheme import DPScheme


class DiLoCoState:
    def __init__(self, named_params, outer_lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                 device: str = "cpu"):
        self.global_params = {n: torch.nn.Parameter(p.detach().to(device).clone()) for n, p in named_params}
        self.outer = torch.optim.SGD(self.global_params.values(), lr=outer_lr, momentum=momentum,
                                     nesterov=nesterov and momentum > 0)

    def state_dict(self) -> dict:
        return {"global": {n: p.detach().clone() for n, p in self.global_params.items()},
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in self.global_params.items():
                p.copy_(state["global"][n])
        self.outer.load_state_dict(state["outer"])


def pseudo_gradient(global_p: torch.Tensor, local_p: torch.Tensor) -> torch.Tensor:
    """theta_global - theta_local (mind the sign: the outer optimizer *descends* along it)."""
    return global_p.detach() - local_p.detach().to(global_p.device)


def outer_step(state: DiLoCoState, named_local, group: Group, rank: int, world: int,
               compressor: PowerSGDState | None = None) -> Generator:
    """One DiLoCo outer step for one replica; leaves local == global afterwards."""
    local = dict(named_local)
    deltas = {n: pseudo_gradient(g, local[n]) for n, g in state.global_params.items()}
    if compressor is not None:
        yield from powersgd_average(compressor, deltas, group, rank, world)
    else:
        yield from allreduce_average(deltas, group, rank, world)
    for n, g in state.global_params.items():
        g.grad = deltas[n]
    state.outer.step()
    state.outer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, g in state.global_params.items():
            local[n].copy_(g)


class DiLoCo(DiLoCoKind, DPScheme):
    """``dp.kind = diloco``: ``dp.inner_steps`` local steps, then ``outer_step`` (its average PowerSGD-compressed
    at ``dp.rank`` > 0); the replicas agree only after an outer step."""

    def __init__(self, cfg, trained, group, member, seed):
        super().__init__(cfg, trained, group, member, seed)
        self.state = DiLoCoState(trained(), cfg.outer_lr, cfg.outer_momentum)
        self.compressor = PowerSGDState(rank=cfg.rank, start_step=0, seed=seed) if cfg.rank > 0 else None

    def after_step(self, step: int) -> Generator:
        if (step + 1) % self.cfg.inner_steps == 0:
            yield from outer_step(self.state, self.trained(), self.group, self.member, self.group.size,
                                  self.compressor)

    def agree_after(self, step: int) -> bool:
        return (step + 1) % self.cfg.inner_steps == 0

    def synchronised(self) -> dict[str, torch.Tensor]:
        """The outer (global) weights: every replica's weights after the last outer step."""
        return {n: p.detach() for n, p in self.state.global_params.items()}

    def state_dict(self) -> dict:
        return {"psgd": self.compressor.state_dict() if self.compressor else None, "diloco": self.state.state_dict()}

    def load_state_dict(self, state: dict) -> Generator:
        if self.compressor is not None and state.get("psgd") is not None:
            self.compressor.load_state_dict(state["psgd"])
        if state.get("diloco") is not None:
            self.state.load_state_dict(state["diloco"])
        yield from ()
