"""PP boundary compressors behind one protocol (see ``base.py``).

A kind is a ``Boundary`` class (one file each) that ``implements`` its description, a ``plugins.py: BoundaryKind``
(settings and properties; the built-in ones in ``config/boundary_kinds.py``) in the one registry of kinds,
``BOUNDARY_KINDS``, where plug-ins register theirs (``plugins.py: register_boundary``)."""

from __future__ import annotations

import torch

from thinpipe.boundary.aqsgd import AqsgdBoundary
from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.boundary.bottleneck import BottleneckBoundary
from thinpipe.boundary.klt import KltBoundary
from thinpipe.boundary.klt_dither import KltDitherBoundary
from thinpipe.boundary.mapl import MaplBoundary
from thinpipe.boundary.mapl_vq import MaplVQBoundary
from thinpipe.boundary.mask import MaskBoundary, kept_dims
from thinpipe.boundary.outlier import OutlierBoundary
from thinpipe.boundary.quant import QuantBoundary
from thinpipe.boundary.ssn import SsnBoundary, SubspaceBasis
from thinpipe.boundary.tahquant import TahQuantBoundary
from thinpipe.boundary.topk import TopKBoundary
from thinpipe.config import BOUNDARY_KINDS, ConfigError

__all__ = ["AqsgdBoundary", "BottleneckBoundary", "Boundary", "KltBoundary", "KltDitherBoundary", "MaplBoundary",
           "MaplVQBoundary",
           "MaskBoundary",
           "OutlierBoundary", "Payload", "QuantBoundary", "SsnBoundary", "SubspaceBasis", "TahQuantBoundary",
           "TopKBoundary", "build_boundaries", "implements", "kept_dims"]


def build_boundaries(cfg, num_stages: int, hidden_size: int, seed: int, wire_dtype: torch.dtype | None,
                     model=None) -> list[Boundary]:
    """One boundary per stage pair: boundary b's kind (``cfg.kind_at(b)``: ``boundary.kinds[b]``, else
    ``boundary.kind``) builds it (``BOUNDARY_KINDS``: built-in and plug-in alike); ``cfg.masked`` selects which get the
    configured kind (the others are dense).

    A kind that ``needs_model`` (ssn, mapl, mapl-vq) takes the vocabulary and token embedding from ``model``;
    call once per replica (each replica owns its copy of the boundary parameters)."""
    shared: dict[str, dict] = {}  # what a kind's boundaries share (its own: two kinds never share)
    out: list[Boundary] = []
    for b in range(num_stages - 1):
        view = cfg.at(b)
        if view.kind not in BOUNDARY_KINDS:
            raise ValueError(f"unknown boundary kind {view.kind!r}")
        spec = BOUNDARY_KINDS[view.kind]
        if spec.needs_model and model is None:
            raise ValueError(f"boundary.kind = {view.kind} needs the model: {spec.needs_model}")
        if cfg.masked and b not in cfg.masked:
            out.append(Boundary(b, hidden_size, wire_dtype))
        else:
            try:
                out.append(spec.build(view, b, hidden_size, seed, wire_dtype, model, shared.setdefault(view.kind, {})))
            except ValueError as e:  # a setting that does not fit the model (known only once it is loaded)
                raise ConfigError(f"boundary.kind = {view.kind} on this model (hidden size {hidden_size}): "
                                  f"{e}") from None
    return out
