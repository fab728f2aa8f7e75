"""Several optimizers stepping as one (AdamW + Muon + SPEL over one stage's parameters).

Param groups may carry ``lr_scale``: the engine sets each group's lr to schedule(step) x lr_scale,
so one schedule drives every optimizer (Muon at train.lr, AdamW at 0.5 x, projectors at 0.1 x)."""

from __future__ import annotations

import torch


class OptimizerGroup:
    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = {k: o for k, o in optimizers.items() if o is not None}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers.values() for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run builds {sorted(self.optimizers)}")
        for k, o in self.optimizers.items():
            o.load_state_dict(state[k])
