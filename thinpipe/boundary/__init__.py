"""PP boundary compressors behind one protocol (see ``base.py``)."""

from __future__ import annotations

import torch

from thinpipe.boundary.aqsgd import AqsgdBoundary
from thinpipe.boundary.base import Boundary, Payload
from thinpipe.boundary.bottleneck import BottleneckBoundary
from thinpipe.boundary.mapl import MaplBoundary
from thinpipe.boundary.mapl_vq import MaplVQBoundary
from thinpipe.boundary.mask import MaskBoundary, kept_dims
from thinpipe.boundary.quant import QuantBoundary
from thinpipe.boundary.ssn import SsnBoundary, SubspaceBasis
from thinpipe.boundary.tahquant import TahQuantBoundary
from thinpipe.boundary.topk import TopKBoundary

__all__ = ["AqsgdBoundary", "BottleneckBoundary", "Boundary", "MaplBoundary", "MaplVQBoundary", "MaskBoundary",
           "Payload", "QuantBoundary", "SsnBoundary", "SubspaceBasis", "TahQuantBoundary", "TopKBoundary",
           "build_boundaries", "kept_dims"]


def build_boundaries(cfg, num_stages: int, hidden_size: int, seed: int, wire_dtype: torch.dtype | None,
                     model=None) -> list[Boundary]:
    """One boundary per stage pair; ``cfg.masked`` selects which get the configured kind.

    The learned kinds (ssn, mapl, mapl-vq) need ``model`` for the vocabulary and token embedding;
    call once per replica (each replica owns its copy of the boundary parameters)."""
    out: list[Boundary] = []
    basis = None
    for b in range(num_stages - 1):
        compressed = not cfg.masked or b in cfg.masked
        if cfg.kind == "identity" or not compressed:
            out.append(Boundary(b, hidden_size, wire_dtype))
        elif cfg.kind == "mask":
            out.append(MaskBoundary(b, hidden_size, cfg.p, seed, cfg.rescale, wire_dtype, cfg.p_warmup))
        elif cfg.kind == "topk":
            out.append(TopKBoundary(b, hidden_size, cfg.p, wire_dtype))
        elif cfg.kind in ("quant4", "quant2", "aqsgd"):
            cls = AqsgdBoundary if cfg.kind == "aqsgd" else QuantBoundary
            out.append(cls(b, hidden_size, *cfg.bits(), cfg.quant_group, wire_dtype))
        elif cfg.kind == "tahquant":
            out.append(TahQuantBoundary(b, hidden_size, *cfg.bits(), cfg.quant_group, cfg.tah_high_fraction,
                                        cfg.tah_outlier_ratio, wire_dtype))
        elif cfg.kind == "bottleneck":
            out.append(BottleneckBoundary(b, hidden_size, cfg.p, seed, wire_dtype))
        elif cfg.kind == "ssn":
            if basis is None:
                basis = SubspaceBasis(hidden_size, cfg.rank, seed)
                token_fixed = model.get_input_embeddings().weight.detach().float().clone()
            out.append(SsnBoundary(b, hidden_size, basis, token_fixed, wire_dtype))
        elif cfg.kind in ("mapl", "mapl-vq"):
            emb = model.get_input_embeddings().weight
            args = (b, hidden_size, cfg.rank, emb.shape[0], emb, seed)
            kw = dict(offset=cfg.offset, trainable=cfg.projector_optim != "fixed", wire_dtype=wire_dtype)
            if cfg.kind == "mapl":
                out.append(MaplBoundary(*args, **kw))
            else:
                out.append(MaplVQBoundary(*args, **kw, codes=cfg.vq_codes, rounds=cfg.vq_rounds,
                                          group_size=cfg.vq_group_size, sync_codes=cfg.vq_sync_codes,
                                          decay=cfg.vq_decay))
        else:
            raise ValueError(f"unknown boundary kind {cfg.kind!r}")
    return out
