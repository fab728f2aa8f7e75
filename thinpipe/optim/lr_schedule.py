"""The paper's recipe (App. I.3): cosine to min_lr_ratio x lr with linear warm-up; global-norm clip."""

from __future__ import annotations

import math

import torch


def cosine_with_warmup(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based)."""
    warmup = int(math.ceil(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def tensor_norms(params) -> torch.Tensor:
    """Per-tensor L2 norms of the gradients (a small vector each stage can share)."""
    params = list(params)
    norms = [torch.linalg.vector_norm(p.grad.detach().float(), 2) for p in params if p.grad is not None]
    return torch.stack(norms) if norms else torch.zeros(0, device=params[0].device if params else None)


def clip_coefficient(all_norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """(total norm, multiplier <= 1) from every stage's per-tensor norms, concatenated in model order
    (the same reduction torch.nn.utils.clip_grad_norm_ performs on the unsplit model)."""
    total = float(torch.linalg.vector_norm(all_norms, 2)) if all_norms.numel() else 0.0
    if max_norm <= 0:
        return total, 1.0
    coef = max_norm / (total + 1e-6)
    return total, min(coef, 1.0)
