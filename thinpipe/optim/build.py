"""Build one stage's optimizer from the config: which parameter goes to which update rule.

- MAPL projectors (``boundary_modules.out_projector.A``): SPEL (§3.3) at boundary.projector_lr_scale
  x lr, or plain Muon (Table 5's unconstrained ablation), or nothing (``fixed``: not trainable).
- everything else: AdamW (train.optimizer = adamw), or Muon for the decoder layers' 2-D weights
  and AdamW at optim.muon.adam_lr_scale x lr for embeddings, head, norms and MAPL stage offsets.
- with the anchor circuit, the result is wrapped in the spectral correction (paper 1, §3.2).

A plain AdamW over all of a stage's parameters (the only optimizer before MAPL) is returned
unwrapped, so those runs keep exactly their earlier numerics."""

from __future__ import annotations

import torch

from thinpipe.optim.composite import OptimizerGroup
from thinpipe.optim.muon import Muon, is_hidden_matrix
from thinpipe.optim.spectral import SpectralCorrection
from thinpipe.optim.stiefel import SPEL

PROJECTOR = "boundary_modules.out_projector.A"


def _adamw(params, cfg, scale: float = 1.0):
    t = cfg.train
    if not params:
        return None
    return torch.optim.AdamW([{"params": params, "lr_scale": scale}], lr=t.lr * scale, betas=(t.beta1, t.beta2),
                             weight_decay=t.weight_decay, fused=True)


def build_stage_optimizer(stage, cfg, index: int):
    t, b = cfg.train, cfg.boundary
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
    projector = [p for n, p in named if n == PROJECTOR]
    rest = [(n, p) for n, p in named if n != PROJECTOR]
    if t.optimizer == "adamw":
        parts = {"adamw": _adamw([p for _, p in rest], cfg)}
    else:
        m = cfg.optim.muon
        hidden = [p for n, p in rest if is_hidden_matrix(n, p)]
        parts = {"muon": Muon([{"params": hidden, "lr_scale": 1.0}], lr=t.lr, momentum=m.momentum,
                              weight_decay=t.weight_decay, ns_steps=m.ns_steps) if hidden else None,
                 "adamw": _adamw([p for n, p in rest if not is_hidden_matrix(n, p)], cfg, m.adam_lr_scale)}
    if projector:
        lr = t.lr * b.projector_lr_scale
        group = [{"params": projector, "lr_scale": b.projector_lr_scale}]
        parts["projector"] = (SPEL(group, lr=lr, beta=b.projector_beta) if b.projector_optim == "spel"
                              else Muon(group, lr=lr, momentum=cfg.optim.muon.momentum))
    inner = parts["adamw"] if set(k for k, v in parts.items() if v is not None) == {"adamw"} else OptimizerGroup(parts)
    if not cfg.mesh.anchor:
        return inner
    sp = cfg.optim.spectral
    # Same seed on every replica of a stage: identical bases keep DP replicas identical.
    return SpectralCorrection(stage.named_parameters(), inner, tau=sp.tau, alpha=sp.alpha, beta=sp.beta,
                              rank=sp.rank, relative_tau=sp.relative_tau, bias_correction=sp.bias_correction,
                              seed=t.seed * 131 + index)
