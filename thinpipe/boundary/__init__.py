"""PP boundary compressors behind one protocol (see ``base.py``)."""

from __future__ import annotations

import torch

from thinpipe.boundary.aqsgd import AqsgdBoundary
from thinpipe.boundary.base import Boundary, Payload
from thinpipe.boundary.bottleneck import BottleneckBoundary
from thinpipe.boundary.klt import KltBoundary
from thinpipe.boundary.mapl import MaplBoundary
from thinpipe.boundary.mapl_vq import MaplVQBoundary
from thinpipe.boundary.mask import MaskBoundary, kept_dims
from thinpipe.boundary.outlier import OutlierBoundary
from thinpipe.boundary.quant import QuantBoundary
from thinpipe.boundary.ssn import SsnBoundary, SubspaceBasis
from thinpipe.boundary.tahquant import TahQuantBoundary
from thinpipe.boundary.topk import TopKBoundary
from thinpipe.config import ConfigError
from thinpipe.plugins import PLUGIN_BOUNDARIES

__all__ = ["AqsgdBoundary", "BottleneckBoundary", "Boundary", "KltBoundary", "MaplBoundary", "MaplVQBoundary",
           "MaskBoundary",
           "OutlierBoundary", "Payload", "QuantBoundary", "SsnBoundary", "SubspaceBasis", "TahQuantBoundary",
           "TopKBoundary", "build_boundaries", "kept_dims"]


def _mask(cfg, b, hidden, seed, wire_dtype, model, shared):
    return MaskBoundary(b, hidden, cfg.p, seed, cfg.rescale, wire_dtype, cfg.p_warmup)


def _topk(cfg, b, hidden, seed, wire_dtype, model, shared):
    return TopKBoundary(b, hidden, cfg.p, wire_dtype)


def _quant(cfg, b, hidden, seed, wire_dtype, model, shared):
    cls = AqsgdBoundary if cfg.kind == "aqsgd" else QuantBoundary
    return cls(b, hidden, *cfg.bits(), cfg.quant_group, wire_dtype)


def _tahquant(cfg, b, hidden, seed, wire_dtype, model, shared):
    return TahQuantBoundary(b, hidden, *cfg.bits(), cfg.quant_group, cfg.tah_high_fraction, cfg.tah_outlier_ratio,
                            wire_dtype)


def _outlier(cfg, b, hidden, seed, wire_dtype, model, shared):
    intact = None if cfg.outlier_dtype == "wire" else torch.bfloat16
    fwd, bwd = cfg.bits()
    if cfg.outlier_fwd_bits:
        if len(cfg.outlier_fwd_bits) <= b:
            raise ValueError(f"boundary.outlier_fwd_bits = {cfg.outlier_fwd_bits} names no bits for boundary {b}: "
                             "give one entry per boundary (mesh.pp - 1)")
        fwd = cfg.outlier_fwd_bits[b]
    return OutlierBoundary(b, hidden, cfg.outlier_channels, fwd, bwd, cfg.quant_group, wire_dtype,
                           cfg.outlier_scale_group, intact, grid=cfg.outlier_grid,
                           bwd_scale_group=cfg.outlier_bwd_scale_group, bwd_tokens=cfg.outlier_bwd_tokens,
                           compress=cfg.compress)


def _klt(cfg, b, hidden, seed, wire_dtype, model, shared):
    return KltBoundary(b, hidden, cfg.klt_bits, cfg.klt_context_bits, cfg.bits()[1], cfg.quant_group, wire_dtype,
                       channels=cfg.klt_channels, bwd_tokens=cfg.klt_bwd_tokens, refresh_every=cfg.klt_refresh_every,
                       scale=cfg.klt_scale, basis_dtype=cfg.klt_basis_dtype)


def _bottleneck(cfg, b, hidden, seed, wire_dtype, model, shared):
    return BottleneckBoundary(b, hidden, cfg.p, seed, wire_dtype)


def _ssn(cfg, b, hidden, seed, wire_dtype, model, shared):
    if "ssn_basis" not in shared:  # one basis for every boundary of the replica
        token_fixed = model.get_input_embeddings().weight.detach().float().clone()
        shared["ssn_basis"] = SubspaceBasis(hidden, cfg.rank, seed, token_fixed, cfg.ssn_refresh_every,
                                            cfg.ssn_refresh_lr)
    basis = shared["ssn_basis"]
    return SsnBoundary(b, hidden, basis, basis.token_fixed, wire_dtype)


def _mapl(cfg, b, hidden, seed, wire_dtype, model, shared):
    emb = model.get_input_embeddings().weight
    args = (b, hidden, cfg.rank, emb.shape[0], emb, seed)
    kw = dict(offset=cfg.offset, trainable=cfg.projector_optim != "fixed", wire_dtype=wire_dtype,
              pca_start=cfg.init == "pca")
    if cfg.kind == "mapl":
        return MaplBoundary(*args, **kw)
    return MaplVQBoundary(*args, **kw, codes=cfg.vq_codes, rounds=cfg.vq_rounds, group_size=cfg.vq_group_size,
                          sync_codes=cfg.vq_sync_codes, decay=cfg.vq_decay)


BUILTIN = {"mask": _mask, "topk": _topk, "quant4": _quant, "quant2": _quant, "aqsgd": _quant, "tahquant": _tahquant,
           "outlier": _outlier, "klt": _klt, "bottleneck": _bottleneck, "ssn": _ssn, "mapl": _mapl, "mapl-vq": _mapl}


def build_boundaries(cfg, num_stages: int, hidden_size: int, seed: int, wire_dtype: torch.dtype | None,
                     model=None) -> list[Boundary]:
    """One boundary per stage pair; ``cfg.masked`` selects which get the configured kind (the others
    are dense). A kind is a builder in ``BUILTIN`` or one a plugin registered (``plugins.py``).

    The learned kinds (ssn, mapl, mapl-vq) need ``model`` for the vocabulary and token embedding;
    call once per replica (each replica owns its copy of the boundary parameters)."""
    builders = {**BUILTIN, **PLUGIN_BOUNDARIES}
    if cfg.kind != "identity" and cfg.kind not in builders:
        raise ValueError(f"unknown boundary kind {cfg.kind!r}")
    shared: dict = {}
    out: list[Boundary] = []
    for b in range(num_stages - 1):
        compressed = not cfg.masked or b in cfg.masked
        if cfg.kind == "identity" or not compressed:
            out.append(Boundary(b, hidden_size, wire_dtype))
        else:
            try:
                out.append(builders[cfg.kind](cfg, b, hidden_size, seed, wire_dtype, model, shared))
            except ValueError as e:  # a setting that does not fit the model (known only once it is loaded)
                raise ConfigError(f"boundary.kind = {cfg.kind} on this model (hidden size {hidden_size}): "
                                  f"{e}") from None
    return out
