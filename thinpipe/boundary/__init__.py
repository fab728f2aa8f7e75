"""PP boundary compressors behind one protocol (see ``base.py``)."""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Boundary, Payload
from thinpipe.boundary.mask import MaskBoundary, kept_dims
from thinpipe.boundary.topk import TopKBoundary

__all__ = ["Boundary", "MaskBoundary", "Payload", "TopKBoundary", "build_boundaries", "kept_dims"]


def build_boundaries(cfg, num_stages: int, hidden_size: int, seed: int, wire_dtype: torch.dtype | None) -> list[Boundary]:
    """One boundary per stage pair; ``cfg.masked`` selects which get the configured kind."""
    out: list[Boundary] = []
    for b in range(num_stages - 1):
        compressed = not cfg.masked or b in cfg.masked
        if cfg.kind == "identity" or not compressed:
            out.append(Boundary(b, hidden_size, wire_dtype))
        elif cfg.kind == "mask":
            out.append(MaskBoundary(b, hidden_size, cfg.p, seed, cfg.rescale, wire_dtype, cfg.p_warmup))
        elif cfg.kind == "topk":
            out.append(TopKBoundary(b, hidden_size, cfg.p, wire_dtype))
        else:
            raise ValueError(f"unknown boundary kind {cfg.kind!r}")
    return out
