"""The router auxiliary loss of a mixture-of-experts stage: transformers' load-balancing loss of its own routers.

transformers adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, mask)`` to a
MoE model's loss when ``config.output_router_logits`` is set (``MixtralForCausalLM.forward`` and its siblings; Switch
Transformer's eq. 4: ``E * sum_e f_e * P_e``, the fraction of top-k assignments to expert e times its mean router
probability). A stage computes the same function of **its own layers' router logits**, captured by forward hooks on
the modules transformers itself records them from (``_can_record_outputs["router_logits"]``), and weighs it by its
share of the model's MoE layers. The loss is local to the stage: nothing of it crosses a boundary, nothing is metered.

With one stage this is transformers' loss exactly. With several, ``f`` and ``P`` are each stage's own means rather
than the whole model's (the unsplit function is a product of means over every layer, which would need each
stage's per-expert sums on the wire); each stage then balances its own layers, and an evenly balanced model scores
the same ``top_k`` either way. ``docs/models.md`` says so.

The term enters the backward without changing the value a stage returns (``attach``): the logged ``loss`` stays the
objective's, and ``router_aux_loss`` is reported beside it (the mean over microbatches of the stages' weighted sum).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RouterLoss:
    """What a stage needs of its model to compute the loss (``of_model``)."""

    router_class: type
    """The router module whose forward output (``index``) is a layer's router logits (N tokens, E experts)."""
    index: int
    loss_fn: object
    """The family's own ``load_balancing_loss_func``."""
    num_experts: int
    top_k: int
    coef: float
    """``router_aux_loss_coef``: what the loss is multiplied by when it trains (``train``)."""
    train: bool
    """``config.output_router_logits``: whether transformers adds it to the training loss."""
    moe_layers: int
    """The model's layers holding a router (the stages' weights: each stage's share of them)."""

    @classmethod
    def of_model(cls, model: nn.Module) -> "RouterLoss | None":
        """The loss's parts for a transformers MoE causal LM (None: the model records no router logits, or its
        family has no load-balancing function)."""
        recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if recorder is None or loss_fn is None or not hasattr(model, "num_experts"):
            return None
        routers = [m for m in model.modules() if isinstance(m, recorder.target_class)]
        return cls(recorder.target_class, recorder.index or 0, loss_fn, int(model.num_experts),
                   int(model.num_experts_per_tok), float(model.router_aux_loss_coef),
                   bool(getattr(model.config, "output_router_logits", False)), len(routers))

    def capture(self, layers) -> "Capture":
        return Capture(self, [m for layer in layers for m in layer.modules() if isinstance(m, self.router_class)])


class Capture:
    """Collects the router logits of one forward of a stage's layers (a context manager around the layer loop)."""

    def __init__(self, spec: RouterLoss, routers: list[nn.Module]):
        self.spec, self.routers, self.logits, self._hooks = spec, routers, [], []

    def __enter__(self) -> "Capture":
        def keep(module, args, out):
            self.logits.append(out[self.spec.index] if isinstance(out, tuple) else out)
        self._hooks = [r.register_forward_hook(keep) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def loss(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        """The family's load-balancing loss of the captured logits, weighted by this stage's share of the model's MoE
        layers (None: no router ran). ``padding``: (B, T) bool, True on padding tokens (excluded, as transformers
        excludes them by the attention mask), or None."""
        if not self.logits:
            return None
        s = self.spec
        mask = None if padding is None or not bool(padding.any()) else (~padding).long()
        aux = s.loss_fn(tuple(self.logits), s.num_experts, s.top_k, mask)
        return aux * (len(self.logits) / s.moe_layers)


class _Attach(torch.autograd.Function):
    """Returns ``x`` unchanged; in the backward also sends gradient 1 into ``extra`` (a scalar loss term)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra_dtype = extra.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.extra_dtype, device=grad.device)


def attach(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``x`` whose backward also back-propagates the scalar ``extra`` (a stage's own loss term: its gradient reaches
    the routers through whichever backward the engine runs from ``x``, a boundary's gradient or the loss)."""
    return _Attach.apply(x, extra)
