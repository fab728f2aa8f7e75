"""The PP boundary compressor: the ``[boundary]`` section and its kinds."""

from __future__ import annotations

from dataclasses import dataclass, field

from thinpipe.config.errors import ConfigError
from thinpipe.plugins import PLUGIN_BOUNDARIES

BOUNDARY_KINDS = ("identity", "mask", "topk", "ssn", "mapl", "mapl-vq", "quant4", "quant2", "aqsgd", "tahquant",
                  "bottleneck", "outlier", "klt")
# Part of the model: training and evaluation run through them.
ARCHITECTURAL_KINDS = ("ssn", "mapl", "mapl-vq", "bottleneck")
# (forward, backward) bits of the quantising kinds when boundary.fwd_bits / bwd_bits are 0:
# Table 4's 4-bit Quant (4x against a 16-bit wire) and AQ-SGD / TAH-Quant at "8/2x".
QUANT_BITS = {"quant4": (4, 4), "quant2": (2, 2), "aqsgd": (2, 8), "tahquant": (2, 8), "outlier": (2, 2),
              "klt": (0, 1)}


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
    tokens that carry loss; issue 36). docs/baselines.md has each one's details."""
    p: float = 0.95
    """Mask ratio p for ``mask`` and ``topk``: each token keeps K = round((1-p) H) of its H hidden dims."""
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
    vq_codes: int = 256
    """``mapl-vq``: codes K per codebook (Table 8: 256)."""
    vq_rounds: int = 2
    """``mapl-vq``: residual rounds R (Table 8: 2)."""
    vq_group_size: int = 2
    """``mapl-vq``: dims per quantised group g (Table 8: G = 2); rank must be a multiple."""
    vq_sync_codes: int = 1
    """``mapl-vq``: codebook slots streamed per microbatch and direction (§3.5: 1/K of the codebook)."""
    vq_decay: float = 0.95
    """``mapl-vq``: EMA decay of the k-means codebook updates."""
    fwd_bits: int = 0
    """Quantising kinds: bits per activation value (0 = the kind's default: quant4 4, quant2 2,
    aqsgd / tahquant 2)."""
    bwd_bits: int = 0
    """Quantising kinds: bits per activation-gradient value (0 = default: quant4 4, quant2 2,
    aqsgd / tahquant 8, i.e. Table 4's 8x forward / 2x backward against a 16-bit wire)."""
    quant_group: int = 64
    """Quantising kinds: hidden dims per scale group (tile) of one token; 0 = one group per token.
    Must divide the hidden size (tahquant: a power of two <= 64)."""
    tah_high_fraction: float = 0.25
    """``tahquant``: fraction of tiles (highest code entropy) quantised with one extra bit."""
    tah_outlier_ratio: float = 4.0
    """``tahquant``: a tile whose absmax exceeds this many times its RMS is Hadamard-rotated."""
    outlier_channels: int = 16
    """``outlier``: channels sent intact in the wire dtype (the C with the largest mean |activation|,
    calibrated once on the residual start's batches, ``boundary.pca_batches``)."""
    outlier_scale_group: int = 0
    """``outlier``: hidden dims that share one offset and step in the forward (0 = the rotation
    tile, ``quant_group``; -1 or the hidden size = one pair per token). A multiple of
    ``quant_group`` that divides the hidden size. The backward's is ``outlier_bwd_scale_group``."""
    outlier_dtype: str = "wire"
    """``outlier``: the intact channels' dtype: ``wire`` (``boundary.dtype``) or ``bfloat16``."""
    outlier_grid: str = "minmax"
    """``outlier``: the rotated values' grid, both ways: ``minmax`` (uniform between each group's min
    and max, bf16 offset + step: 4 B per group) or ``lloyd-max`` (the Lloyd-Max levels of a unit
    Gaussian scaled by the group's RMS, one bf16 scale: 2 B per group; boundary/lloyd_max.py)."""
    outlier_fwd_bits: list[int] = field(default_factory=list)
    """``outlier``: forward bits of each boundary in order (one entry per boundary, 1..8), overriding
    ``fwd_bits``: the boundaries are not equally sensitive (``thinpipe probe --boundaries``), so the
    bits go where the damage is. Empty: ``fwd_bits`` everywhere."""
    outlier_bwd_scale_group: int = 0
    """``outlier``: hidden dims that share one scale in the backward (0 = the tile, ``quant_group``;
    -1 or the hidden size = one per token); the same rules as ``outlier_scale_group``."""
    outlier_bwd_tokens: float = 1.0
    """``outlier``: fraction of a microbatch's tokens whose activation gradient is sent back (those
    with the largest gradient norm; a bitmap of 1 bit per token says which); the rest arrive as 0."""
    compress: str = "both"
    """``outlier``: the directions compressed: ``both``, ``fwd`` (the gradient crosses dense in the
    wire dtype) or ``bwd`` (the activation crosses dense): the forward/backward split of a setting's
    loss (experiments/frontier/README.md)."""
    klt_bits: float = 3.0
    """``klt``: forward bits per hidden dim, on average, of a token whose output is scored by the loss
    (allocated over the KLT components by reverse water-filling; whole bits, 1..8 per component)."""
    klt_context_bits: float = 1.0
    """``klt``: forward bits per hidden dim, on average, of every other token (prompt, padding)."""
    klt_channels: int = 4
    """``klt``: the C channels with the largest mean |activation| (calibrated at the start, as
    ``outlier_channels``), sent intact in bf16; the basis codes the rest (SmolLM2's massive activations
    sit in a few channels: C = 4 codes its boundaries 1-10x better than C = 0, C = 16 little better)."""
    klt_scale: str = "width"
    """``klt``: a token's scales: ``width`` (one bf16 RMS per token for each bit width its table codes,
    ~6-8; the coefficients of a few heavy tokens sit far from their components' variances, and one
    scale per token clips them: 100x the error on SmolLM2's middle boundary) or ``token`` (one)."""
    klt_bwd_tokens: float = 0.5
    """``klt``: fraction of a microbatch's tokens whose activation gradient is sent back (the largest by
    norm; a bitmap of 1 bit per token names them), on ``outlier``'s Lloyd-Max grid at ``bwd_bits``
    (default 1) with one scale per token."""
    klt_basis_dtype: str = "bfloat16"
    """``klt``: the start's basis on the wire: ``bfloat16`` or ``int8`` (one bf16 step per column: half the
    bytes, 38 -> 19 B/token on the 100-step frontier recipe; an entry's error ~1% of its size, far below
    the codes')."""
    klt_refresh_every: int = 0
    """``klt``: every N steps both ends refit the forward basis and tables from the decoded activations
    of the steps since the last refit, and fit (then refit) the gradient's own basis from the decoded
    gradients, which switches the backward from Hadamard tiles to it; no bytes cross (both ends hold
    that data). 0 = never: the start's basis all run, the Hadamard backward. A refreshing boundary is
    refused with GSPO (its two forwards of a sequence must code it alike)."""
    ssn_refresh_every: int = 500
    """``ssn``: Grassmann refresh of the shared basis every N steps (Table 8: 500; 0 = never)."""
    ssn_refresh_lr: float = 0.01
    """``ssn``: Grassmann step size (Table 8: 1e-2)."""

    def bits(self) -> tuple[int, int]:
        """(forward, backward) bits of a quantising kind, defaults filled in."""
        fwd, bwd = QUANT_BITS.get(self.kind, (0, 0))
        return self.fwd_bits or fwd, self.bwd_bits or bwd

    def validate(self) -> None:
        if self.kind not in BOUNDARY_KINDS and self.kind not in PLUGIN_BOUNDARIES:
            raise ConfigError(f"boundary.kind = {self.kind!r} is unknown: choose one of "
                              f"{', '.join(BOUNDARY_KINDS + tuple(PLUGIN_BOUNDARIES))}")
        if not 0.0 <= self.p < 1.0:
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
        if self.kind == "mapl-vq":
            if self.rank % self.vq_group_size:
                raise ConfigError(f"boundary.rank = {self.rank} must be a multiple of boundary.vq_group_size = "
                                  f"{self.vq_group_size}")
            if not 2 <= self.vq_codes or self.vq_rounds < 1 or not 1 <= self.vq_sync_codes <= self.vq_codes:
                raise ConfigError("boundary.vq_codes must be >= 2, vq_rounds >= 1 and 1 <= vq_sync_codes <= vq_codes")
            if not 0 <= self.vq_decay < 1:
                raise ConfigError(f"boundary.vq_decay must be in [0, 1), got {self.vq_decay}")
        if not 0 <= self.fwd_bits <= 8 or not 0 <= self.bwd_bits <= 8:
            raise ConfigError(f"boundary.fwd_bits and boundary.bwd_bits must be in 1..8 (0 = the kind's default), got "
                              f"{self.fwd_bits} and {self.bwd_bits}")
        if self.kind == "tahquant" and self.bits()[0] > 7:
            raise ConfigError("boundary.fwd_bits must be <= 7 for tahquant (its high-entropy tiles get one more bit)")
        if self.quant_group < 0:
            raise ConfigError(f"boundary.quant_group must be >= 0 (0 = per token), got {self.quant_group}")
        if self.kind == "tahquant" and (not self.quant_group or self.quant_group & (self.quant_group - 1)
                                        or self.quant_group > 64):
            raise ConfigError(f"boundary.quant_group must be a power of two <= 64 for tahquant (its Hadamard tiles), "
                              f"got {self.quant_group}")
        if not 0 <= self.tah_high_fraction <= 1 or self.tah_outlier_ratio <= 0:
            raise ConfigError("boundary.tah_high_fraction must be in [0, 1] and boundary.tah_outlier_ratio > 0, got "
                              f"{self.tah_high_fraction} and {self.tah_outlier_ratio}")
        if self.outlier_channels < 0:
            raise ConfigError(f"boundary.outlier_channels must be >= 0, got {self.outlier_channels}")
        if self.outlier_scale_group < -1 or self.outlier_dtype not in ("wire", "bfloat16"):
            raise ConfigError("boundary.outlier_scale_group must be >= -1 and boundary.outlier_dtype wire or bfloat16, "
                              f"got {self.outlier_scale_group} and {self.outlier_dtype!r}")
        if self.outlier_grid not in ("minmax", "lloyd-max") or self.outlier_bwd_scale_group < -1:
            raise ConfigError("boundary.outlier_grid must be minmax or lloyd-max and boundary.outlier_bwd_scale_group "
                              f">= -1, got {self.outlier_grid!r} and {self.outlier_bwd_scale_group}")
        if any(not 1 <= b <= 8 for b in self.outlier_fwd_bits):
            raise ConfigError(f"boundary.outlier_fwd_bits holds bits in 1..8, one per boundary, got "
                              f"{self.outlier_fwd_bits}")
        if not 0 < self.outlier_bwd_tokens <= 1:
            raise ConfigError(f"boundary.outlier_bwd_tokens must be in (0, 1], got {self.outlier_bwd_tokens}")
        if self.compress not in ("both", "fwd", "bwd"):
            raise ConfigError(f"boundary.compress must be both, fwd or bwd, got {self.compress!r}")
        if self.compress != "both" and self.kind != "outlier":
            raise ConfigError(f"boundary.compress = {self.compress} is an outlier setting; boundary.kind is "
                              f"{self.kind}")
        if self.kind == "outlier" and self.quant_group & (self.quant_group - 1):
            raise ConfigError(f"boundary.quant_group must be a power of two for outlier (its Hadamard tiles), got "
                              f"{self.quant_group}")
        if not 0 < self.klt_bits <= 8 or not 0 < self.klt_context_bits <= 8 or not 0 < self.klt_bwd_tokens <= 1:
            raise ConfigError("boundary.klt_bits and boundary.klt_context_bits must be in (0, 8] bits per dim and "
                              f"boundary.klt_bwd_tokens in (0, 1], got {self.klt_bits}, {self.klt_context_bits} "
                              f"and {self.klt_bwd_tokens}")
        if self.klt_basis_dtype not in ("bfloat16", "int8"):
            raise ConfigError(f"boundary.klt_basis_dtype must be bfloat16 or int8, got {self.klt_basis_dtype!r}")
        if self.klt_scale not in ("width", "token"):
            raise ConfigError(f"boundary.klt_scale must be width or token, got {self.klt_scale!r}")
        if self.klt_channels < 0 or self.klt_refresh_every < 0:
            raise ConfigError(f"boundary.klt_channels and boundary.klt_refresh_every must be >= 0, got "
                              f"{self.klt_channels} and {self.klt_refresh_every}")
        if self.kind == "klt" and self.quant_group & (self.quant_group - 1):
            raise ConfigError(f"boundary.quant_group must be a power of two for klt (its backward's Hadamard tiles), "
                              f"got {self.quant_group}")
        if self.ssn_refresh_every < 0 or self.ssn_refresh_lr < 0:
            raise ConfigError("boundary.ssn_refresh_every and boundary.ssn_refresh_lr must be >= 0")
