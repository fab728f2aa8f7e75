"""The PP boundary compressor: the ``[boundary]`` section (the settings its kinds share) and each kind's own table,
``[boundary.<kind>]``.

A kind describes itself (``plugins.py: BoundaryKind``; the built-in ones: ``config/boundary_kinds.py``): its table's
keys and their checks, whether it is part of the model, its default bits. This section holds the tables given, by
kind, checks each with its kind, and records the configured kind's table only (``to_dict``), so a run folder's
``config.toml`` names the settings its run used. The flat keys of before (``boundary.klt_bits``) are aliases of the
tables' keys (``config/aliases.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import thinpipe.config.boundary_kinds  # noqa: F401  (registers the built-in kinds)
from thinpipe.config.errors import ConfigError
from thinpipe.plugins import BOUNDARY_KINDS, BoundaryKind


@dataclass(kw_only=True, slots=True)
class BoundaryConfig:
    kind: str = "identity"
    """PP boundary compressor: ``identity`` (dense), ``mask`` (PRF random activation masking, §3.1),
    ``topk`` (the K largest-magnitude dims per token, indices sent; App. F's biased baseline),
    ``ssn`` (Subspace Networks: fixed shared basis, confined weights; MAPL App. A), ``mapl`` (learned
    Stiefel projector + per-stage offsets; MAPL §3.2) or ``mapl-vq`` (MAPL + residual VQ; §3.5); the
    activation-compression baselines of anchor-priors Table 4: ``quant4`` / ``quant2`` (uniform
    4 / 2-bit), ``aqsgd`` (AQ-SGD: quantised change against a per-example buffer), ``tahquant``
    (tile-wise adaptive Hadamard quantisation) and ``bottleneck`` (a learned linear down/up pair
    of K = (1-p) H dims); ``outlier`` (not in the papers: calibrated outlier channels sent intact,
    the rest Hadamard-rotated and quantised; experiments/frontier/README.md); ``klt`` (not in the papers:
    transform coding in the activations' own KLT basis, bits by reverse water-filling, more bits on the
    tokens that carry loss; issue 36), or a plug-in's (``plugins.py``). docs/baselines.md has each one's
    details; a kind's own settings are its table ``[boundary.<kind>]`` (``config/boundary_kinds.py``)."""
    p: float | list[float] = 0.95
    """Mask ratio p for ``mask`` and ``topk``: each token keeps K = round((1-p) H) of its H hidden dims. One ratio,
    or one per boundary (``[0.75, 0.95, 0.75]``: the slow link's boundary masks more; ``thinpipe plan`` writes such
    lists for uneven links)."""
    rescale: bool = True
    """Scale kept values by 1/(1-p) at the receiver so the masked activation is unbiased (App. F)."""
    masked: list[int] = field(default_factory=list)
    """Which boundaries (0 = between stage 0 and 1) are compressed; empty = all."""
    p_warmup: int = 0
    """Variant (not in the paper): ramp the mask ratio linearly from 0 to p over this many steps."""
    dtype: str = "auto"
    """Wire dtype of activations and their gradients: ``auto`` (the training dtype), ``float32``, ``bfloat16``."""
    rank: int = 64
    """Projection rank r for ``ssn``, ``mapl`` and ``mapl-vq``: r values per token cross the wire."""
    projector_optim: str = "spel"
    """How MAPL projectors learn (MAPL Table 5): ``spel`` (Stiefel steepest descent, §3.3),
    ``muon`` (unconstrained, leaves the manifold) or ``fixed`` (a frozen random orthonormal A)."""
    projector_lr_scale: float = 0.1
    """Projector learning rate as a multiple of train.lr (MAPL App. E.4: 0.1)."""
    projector_beta: float = 0.9
    """SPEL heavy-ball momentum beta (eq. 5; the paper does not state it)."""
    offset: str = "factorized"
    """MAPL per-stage token-dependent offset (Table 6; the paper's "anchor", renamed so as not to
    clash with the anchor circuit): ``factorized`` (E_small P), ``full`` (a V x d table per stage),
    ``static`` (the frozen token embedding) or ``none``. ``boundary.anchor`` is a deprecated alias."""
    init: str = "random"
    """MAPL projector start: ``random`` (seeded orthonormal, the paper) or ``pca`` (the top-r principal
    directions of the boundary activations on a few training batches; for adapting pretrained models)."""
    pca_batches: int = 4
    """Training batches the ``pca`` start looks at."""
    fwd_bits: int = 0
    """Quantising kinds: bits per activation value (0 = the kind's default: quant4 4, quant2 2,
    aqsgd / tahquant 2)."""
    bwd_bits: int = 0
    """Quantising kinds: bits per activation-gradient value (0 = default: quant4 4, quant2 2,
    aqsgd / tahquant 8, i.e. Table 4's 8x forward / 2x backward against a 16-bit wire)."""
    quant_group: int = 64
    """Quantising kinds: hidden dims per scale group (tile) of one token; 0 = one group per token.
    Must divide the hidden size (tahquant: a power of two <= 64)."""
    compress: str = "both"
    """A kind that may compress one way (``one_way``: ``outlier``): the directions compressed: ``both``, ``fwd``
    (the gradient crosses dense in the wire dtype) or ``bwd`` (the activation crosses dense): the forward/backward
    split of a setting's loss (experiments/frontier/README.md)."""
    kinds: list[str] = field(default_factory=list)
    """A kind per boundary (0 = between stages 0 and 1), e.g. ``["outlier", "klt-dither", "identity"]``: the links
    of an uneven mesh each get their own codec (``thinpipe plan --target-tps`` recommends such a list); each kind
    takes its own table (``[boundary.<kind>]``) and the shared keys above. Empty: ``kind`` on every boundary. A kind
    that is part of the model (MAPL, SSN, bottleneck) chains through every boundary and is not listed here."""
    tables: dict[str, Any] = field(default_factory=dict, metadata={"tables": True})
    """The kinds' own settings given (``[boundary.<kind>]``), by kind; a kind not here has its defaults
    (``settings``). Not a key of its own: each table is ``boundary.<kind>``."""

    def spec(self, kind: str | None = None) -> type[BoundaryKind]:
        """The description of ``kind`` (default: ``boundary.kind``); an unknown kind is a ``ConfigError``."""
        kind = self.kind if kind is None else kind
        if kind not in BOUNDARY_KINDS:
            raise ConfigError(f"boundary.kind = {kind!r} is unknown: choose one of {', '.join(BOUNDARY_KINDS)}")
        return BOUNDARY_KINDS[kind]

    def settings(self, kind: str | None = None) -> BoundaryKind:
        """The own settings of ``kind`` (default: ``boundary.kind``): the table given, or the kind's defaults."""
        kind = self.kind if kind is None else kind
        return self.tables[kind] if kind in self.tables else self.spec(kind)()

    def table(self, kind: str) -> BoundaryKind | None:
        """The table ``[boundary.<kind>]`` to set keys of, made with the kind's defaults on first use; None: no
        registered kind has settings of that name."""
        spec = BOUNDARY_KINDS.get(kind)
        if spec is None or not dataclasses.fields(spec):
            return None
        return self.tables.setdefault(kind, spec())

    def kind_at(self, boundary: int) -> str:
        """The kind of boundary ``boundary``: its entry of ``kinds``, else ``kind``."""
        return self.kinds[boundary] if self.kinds else self.kind

    def at(self, boundary: int) -> "BoundaryConfig":
        """This section as boundary ``boundary``'s kind sees it: ``kind`` is its kind and ``p`` its ratio (the tables
        are shared), so a kind's builder reads its own settings as with one kind everywhere."""
        kind = self.kind_at(boundary)
        p = self.p[boundary] if isinstance(self.p, list) else self.p
        if kind == self.kind and not self.kinds and p == self.p:
            return self
        return dataclasses.replace(self, kind=kind, kinds=[], p=p)

    def bits(self) -> tuple[int, int]:
        """(forward, backward) bits of a quantising kind, its defaults filled in."""
        fwd, bwd = self.spec().default_bits
        return self.fwd_bits or fwd, self.bwd_bits or bwd

    def to_dict(self) -> dict[str, Any]:
        """The shared keys, then the configured kind's table (when it has settings): what ``config.toml`` records."""
        out = dataclasses.asdict(self)
        del out["tables"]
        out: dict[str, Any] = dict(out)
        for kind in dict.fromkeys([self.kind, *self.kinds]):  # the configured kinds' tables, each once
            own = dataclasses.asdict(self.settings(kind)) if kind in BOUNDARY_KINDS else {}
            if own:
                out[kind] = own
        return out

    def validate(self) -> None:
        self.spec()
        if not all(0.0 <= p < 1.0 for p in (self.p if isinstance(self.p, list) else [self.p])):
            raise ConfigError(f"boundary.p must be in [0, 1) (the fraction of dims dropped), got {self.p}")
        if self.p_warmup < 0:
            raise ConfigError(f"boundary.p_warmup must be >= 0 steps, got {self.p_warmup}")
        if any(b < 0 for b in self.masked):
            raise ConfigError(f"boundary.masked holds boundary indices >= 0, got {self.masked}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"boundary.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.rank < 1:
            raise ConfigError(f"boundary.rank must be >= 1, got {self.rank}")
        if self.projector_optim not in ("spel", "muon", "fixed"):
            raise ConfigError(f"boundary.projector_optim must be spel, muon or fixed, got {self.projector_optim!r}")
        if self.projector_lr_scale < 0 or not 0 <= self.projector_beta < 1:
            raise ConfigError("boundary.projector_lr_scale must be >= 0 and boundary.projector_beta in [0, 1), got "
                              f"{self.projector_lr_scale} and {self.projector_beta}")
        if self.offset not in ("factorized", "full", "static", "none"):
            raise ConfigError(f"boundary.offset must be factorized, full, static or none, got {self.offset!r}")
        if self.init not in ("random", "pca"):
            raise ConfigError(f"boundary.init must be random or pca, got {self.init!r}")
        if self.pca_batches < 1:
            raise ConfigError(f"boundary.pca_batches must be >= 1, got {self.pca_batches}")
        if not 0 <= self.fwd_bits <= 8 or not 0 <= self.bwd_bits <= 8:
            raise ConfigError(f"boundary.fwd_bits and boundary.bwd_bits must be in 1..8 (0 = the kind's default), got "
                              f"{self.fwd_bits} and {self.bwd_bits}")
        if self.quant_group < 0:
            raise ConfigError(f"boundary.quant_group must be >= 0 (0 = per token), got {self.quant_group}")
        if self.compress not in ("both", "fwd", "bwd"):
            raise ConfigError(f"boundary.compress must be both, fwd or bwd, got {self.compress!r}")
        if self.compress != "both" and not self.spec().one_way:
            one_way = "/".join(k for k, spec in BOUNDARY_KINDS.items() if spec.one_way)
            raise ConfigError(f"boundary.compress = {self.compress} is an {one_way} setting; boundary.kind is "
                              f"{self.kind}")
        for kind in self.kinds:
            spec = self.spec(kind)
            if spec.architectural:
                raise ConfigError(f"boundary.kinds lists {kind}, which is part of the model (its offsets chain through "
                                  "every boundary): set boundary.kind = " + kind + " for all boundaries instead")
            if self.compress != "both" and not spec.one_way:
                raise ConfigError(f"boundary.compress = {self.compress} is a one-way setting; boundary.kinds lists "
                                  f"{kind}, which compresses both ways")
        if self.kinds and self.masked:
            raise ConfigError("boundary.kinds and boundary.masked both choose boundaries: list identity in "
                              "boundary.kinds for a dense boundary and leave boundary.masked empty")
        for kind in dict.fromkeys([*self.tables, self.kind, *self.kinds]):  # every table given, the kinds configured
            self._check(self.settings(kind).validate, self.at(self.kinds.index(kind)) if kind in self.kinds else self)

    def check_stages(self, stages: int) -> None:
        """The configured kinds' settings fit a pipeline of ``stages`` stages (``mesh.pp``)."""
        if self.kinds and len(self.kinds) != stages - 1:
            raise ConfigError(f"boundary.kinds lists {len(self.kinds)} kinds but the pipeline has {stages - 1} "
                              "boundaries (mesh.pp - 1): give one kind per boundary")
        if isinstance(self.p, list) and len(self.p) != stages - 1:
            raise ConfigError(f"boundary.p lists {len(self.p)} ratios but the pipeline has {stages - 1} boundaries "
                              "(mesh.pp - 1): give one per boundary, or one number for all")
        for b in range(len(self.kinds)) if self.kinds else [None]:
            view = self if b is None else self.at(b)
            self._check(view.settings().check_stages, view, stages)

    @staticmethod
    def _check(check, *args) -> None:
        try:
            check(*args)
        except ValueError as e:  # a kind's own check: one line, as every config error
            raise ConfigError(str(e)) from None
