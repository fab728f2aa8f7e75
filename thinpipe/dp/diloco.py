"""DiLoCo outer step (Douillard et al. 2023, DiLoCo; docs/dp.md), math + explicit state.

Each replica runs H inner steps of its inner optimizer on its own data from the shared global
weights theta. Then, per replica (all hold identical global copies and outer-optimizer states):

    delta   = theta_global - theta_local      pseudo-gradient: a positive outer step moves toward local
    delta  <- average over the DP group       the only communication (optionally PowerSGD-compressed)
    theta_global <- OuterSGD(theta_global, grad = delta)   Nesterov, lr 0.7, momentum 0.9 by default
    theta_local  <- theta_global

The global copy lives on the CPU by default (it is touched once per H steps). ``outer_step`` is a
generator yielding the Works of its collectives (see ``powersgd_average``), so the simulation can
drive several replicas in lockstep and a real rank can overlap the wait with compute.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from thinpipe.comm.protocols import Group
from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.powersgd import PowerSGDState, powersgd_average


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
