"""Optimizers, learning-rate schedule and gradient clipping."""

from thinpipe.optim.lr_schedule import clip_coefficient, cosine_with_warmup, tensor_norms

__all__ = ["clip_coefficient", "cosine_with_warmup", "tensor_norms"]
