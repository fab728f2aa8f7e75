"""The built-in boundary kinds' descriptions (``plugins.py: BoundaryKind``): each one's own settings, its
``[boundary.<kind>]`` table, with their checks, and its properties. The ``Boundary`` classes that implement them are
``thinpipe/boundary/`` (each names its kind with ``boundary/base.py: implements``); docs/baselines.md has each kind's
details. Registered in this order, the order ``boundary.kind``'s errors list them in.

A kind's flat keys of before issue 49 (``boundary.klt_bits``) are aliases of its table's keys (``boundary.klt.bits``):
``flat_prefix`` + key (``config/aliases.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thinpipe.plugins import BoundaryKind, register_boundary

BWD_SELECTS = ("top", "sample")  # a token-sparse backward's rules (boundary/token_sample.py)


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


@register_boundary
@dataclass(kw_only=True, slots=True)
class IdentityKind(BoundaryKind):
    """``identity``: the activation and its gradient cross dense in the wire dtype (``boundary.dtype``)."""
    name = "identity"


@register_boundary
@dataclass(kw_only=True, slots=True)
class MaskKind(BoundaryKind):
    """``mask``: PRF random activation masking (anchor-priors §3.1): K = round((1-p) H) dims per token
    (``boundary.p``, ``rescale``, ``p_warmup``); the mask is regenerated at both ends, never sent."""
    name = "mask"


@register_boundary
@dataclass(kw_only=True, slots=True)
class TopKKind(BoundaryKind):
    """``topk``: the K largest-magnitude dims per token and their indices (App. F's biased baseline)."""
    name = "topk"


@register_boundary
@dataclass(kw_only=True, slots=True)
class Quant4Kind(BoundaryKind):
    """``quant4``: uniform 4-bit quantisation each way (anchor-priors Table 4's Quant, 4x against 16 bits)."""
    name = "quant4"
    default_bits = (4, 4)


@register_boundary
@dataclass(kw_only=True, slots=True)
class Quant2Kind(BoundaryKind):
    """``quant2``: uniform 2-bit quantisation each way."""
    name = "quant2"
    default_bits = (2, 2)


@register_boundary
@dataclass(kw_only=True, slots=True)
class AqsgdKind(BoundaryKind):
    """``aqsgd``: AQ-SGD, the quantised change against a per-example buffer (Table 4's "8/2x")."""
    name = "aqsgd"
    default_bits = (2, 8)


@register_boundary
@dataclass(kw_only=True, slots=True)
class TahQuantKind(BoundaryKind):
    """``tahquant``: tile-wise adaptive Hadamard quantisation (Table 4's "8/2x"); ``[boundary.tahquant]``."""
    name = "tahquant"
    default_bits = (2, 8)
    flat_prefix = "tah_"
    high_fraction: float = 0.25
    """Fraction of tiles (highest code entropy) quantised with one extra bit."""
    outlier_ratio: float = 4.0
    """A tile whose absmax exceeds this many times its RMS is Hadamard-rotated."""

    def validate(self, boundary) -> None:
        if not 0 <= self.high_fraction <= 1 or self.outlier_ratio <= 0:
            raise ValueError("boundary.tahquant.high_fraction must be in [0, 1] and boundary.tahquant.outlier_ratio "
                             f"> 0, got {self.high_fraction} and {self.outlier_ratio}")
        if boundary.kind != self.name:
            return
        if boundary.bits()[0] > 7:
            raise ValueError("boundary.fwd_bits must be <= 7 for tahquant (its high-entropy tiles get one more bit)")
        if not _power_of_two(boundary.quant_group) or boundary.quant_group > 64:
            raise ValueError(f"boundary.quant_group must be a power of two <= 64 for tahquant (its Hadamard tiles), "
                             f"got {boundary.quant_group}")


@register_boundary
@dataclass(kw_only=True, slots=True)
class BottleneckKind(BoundaryKind):
    """``bottleneck``: a learned linear down/up pair of K = (1-p) H dims; part of the model."""
    name = "bottleneck"
    architectural = True


@register_boundary
@dataclass(kw_only=True, slots=True)
class OutlierKind(BoundaryKind):
    """``outlier`` (not in the papers): calibrated outlier channels sent intact, the rest Hadamard-rotated and
    quantised (experiments/frontier/README.md); ``[boundary.outlier]``. Its forward/backward split is
    ``boundary.compress``."""
    name = "outlier"
    default_bits = (2, 2)
    one_way = True
    flat_prefix = "outlier_"
    channels: int = 16
    """Channels sent intact in the wire dtype (the C with the largest mean |activation|, calibrated once on the
    residual start's batches, ``boundary.pca_batches``)."""
    scale_group: int = 0
    """Hidden dims that share one offset and step in the forward (0 = the rotation tile, ``boundary.quant_group``;
    -1 or the hidden size = one pair per token). A multiple of ``quant_group`` that divides the hidden size. The
    backward's is ``bwd_scale_group``."""
    dtype: str = "wire"
    """The intact channels' dtype: ``wire`` (``boundary.dtype``) or ``bfloat16``."""
    grid: str = "minmax"
    """The rotated values' grid, both ways: ``minmax`` (uniform between each group's min and max, bf16 offset +
    step: 4 B per group) or ``lloyd-max`` (the Lloyd-Max levels of a unit Gaussian scaled by the group's RMS, one
    bf16 scale: 2 B per group; boundary/lloyd_max.py)."""
    fwd_bits: list[int] = field(default_factory=list)
    """Forward bits of each boundary in order (one entry per boundary, 1..8), overriding ``boundary.fwd_bits``:
    the boundaries are not equally sensitive (``thinpipe probe --boundaries``), so the bits go where the damage
    is. Empty: ``boundary.fwd_bits`` everywhere."""
    bwd_scale_group: int = 0
    """Hidden dims that share one scale in the backward (0 = the tile, ``boundary.quant_group``; -1 or the hidden
    size = one per token); the same rules as ``scale_group``."""
    bwd_tokens: float = 1.0
    """Fraction of a microbatch's tokens whose activation gradient is sent back (those with the largest gradient
    norm; a bitmap of 1 bit per token says which); the rest arrive as 0."""
    bwd_select: str = "top"
    """Which ``bwd_tokens`` share crosses (boundary/token_sample.py): ``top`` (the largest gradient norms;
    biased: a token with small gradients never reaches the stages before it) or ``sample`` (each token with
    probability ~ its norm, capped at 1, scaled by the inverse in its per-token scale: unbiased, the same bytes)."""
    entropy: bool = False
    """Codes of 2 bits or more cross entropy coded (ANS under the Lloyd-Max cells' probabilities of a unit
    Gaussian, known to both ends; lossless: the same values; ~1.91 / 2.83 / 3.77 bits a code at 2 / 3 / 4 bits).
    Needs ``grid = lloyd-max``. Payloads then vary in length: metered as sent, bounded for the receiver."""

    def validate(self, boundary) -> None:
        if self.channels < 0:
            raise ValueError(f"boundary.outlier.channels must be >= 0, got {self.channels}")
        if self.scale_group < -1 or self.dtype not in ("wire", "bfloat16"):
            raise ValueError("boundary.outlier.scale_group must be >= -1 and boundary.outlier.dtype wire or "
                             f"bfloat16, got {self.scale_group} and {self.dtype!r}")
        if self.grid not in ("minmax", "lloyd-max") or self.bwd_scale_group < -1:
            raise ValueError("boundary.outlier.grid must be minmax or lloyd-max and boundary.outlier.bwd_scale_group "
                             f">= -1, got {self.grid!r} and {self.bwd_scale_group}")
        if any(not 1 <= b <= 8 for b in self.fwd_bits):
            raise ValueError(f"boundary.outlier.fwd_bits holds bits in 1..8, one per boundary, got {self.fwd_bits}")
        if self.entropy and self.grid != "lloyd-max":
            raise ValueError("boundary.outlier.entropy codes the Lloyd-Max grid's codes: set boundary.outlier.grid = "
                             "lloyd-max")
        if not 0 < self.bwd_tokens <= 1 or self.bwd_select not in BWD_SELECTS:
            raise ValueError(f"boundary.outlier.bwd_tokens must be in (0, 1] and bwd_select one of {BWD_SELECTS}, got "
                             f"{self.bwd_tokens} and {self.bwd_select!r}")
        if boundary.kind == self.name and not _power_of_two(boundary.quant_group or 1):
            raise ValueError(f"boundary.quant_group must be a power of two for outlier (its Hadamard tiles), got "
                             f"{boundary.quant_group}")

    def check_stages(self, boundary, stages: int) -> None:
        if self.fwd_bits and len(self.fwd_bits) != stages - 1:
            raise ValueError(f"boundary.outlier.fwd_bits = {self.fwd_bits} needs one entry per boundary: "
                             f"{stages - 1} with mesh.pp = {stages}")


@register_boundary
@dataclass(kw_only=True, slots=True)
class KltKind(BoundaryKind):
    """``klt`` (not in the papers): transform coding in the activations' own KLT basis, bits by reverse
    water-filling, more bits on the tokens that carry loss (issue 36); ``[boundary.klt]``. Its backward is
    ``outlier``'s Lloyd-Max one at ``boundary.bwd_bits`` (default 1)."""
    name = "klt"
    default_bits = (0, 1)
    flat_prefix = "klt_"
    bits: float = 3.0
    """Forward bits per hidden dim, on average, of a token whose output is scored by the loss (allocated over the
    KLT components by reverse water-filling; whole bits, 1..8 per component)."""
    context_bits: float = 1.0
    """Forward bits per hidden dim, on average, of every other token (prompt, padding)."""
    channels: int = 4
    """The C channels with the largest mean |activation| (calibrated at the start, as ``outlier``'s), sent intact
    in bf16; the basis codes the rest (SmolLM2's massive activations sit in a few channels: C = 4 codes its
    boundaries 1-10x better than C = 0, C = 16 little better)."""
    scale: str = "width"
    """A token's scales: ``width`` (one bf16 RMS per token for each bit width its table codes, ~6-8; the
    coefficients of a few heavy tokens sit far from their components' variances, and one scale per token clips
    them: 100x the error on SmolLM2's middle boundary) or ``token`` (one)."""
    bwd_tokens: float = 0.5
    """Fraction of a microbatch's tokens whose activation gradient is sent back (the largest by norm; a bitmap of
    1 bit per token names them), on ``outlier``'s Lloyd-Max grid at ``boundary.bwd_bits`` (default 1) with one
    scale per token."""
    bwd_select: str = "top"
    """Which ``bwd_tokens`` share crosses (boundary/token_sample.py): ``top`` (the largest gradient norms;
    biased: a token with small gradients never reaches the stages before it) or ``sample`` (each token with
    probability ~ its norm, capped at 1, scaled by the inverse in its per-token scale: unbiased, the same bytes)."""
    basis_dtype: str = "bfloat16"
    """The start's basis on the wire: ``bfloat16`` or ``int8`` (one bf16 step per column: half the bytes,
    38 -> 19 B/token on the 100-step frontier recipe; an entry's error ~1% of its size, far below the codes')."""
    refresh_every: int = 0
    """Every N steps both ends refit the forward basis and tables from the decoded activations of the steps since
    the last refit, and fit (then refit) the gradient's own basis from the decoded gradients, which switches the
    backward from Hadamard tiles to it; no bytes cross (both ends hold that data). 0 = never: the start's basis
    all run, the Hadamard backward. A refreshing boundary is refused with GSPO (its two forwards of a sequence
    must code it alike)."""
    noise_equivalent: bool = False
    """A diagnosis, not a codec (issue 52): the forward sends the activations plus zero-mean Gaussian noise, fresh
    every microbatch, with the codec's own error power in each KLT direction and token class (and in the directions
    the basis drops), dense fp32 on the wire. It asks whether the codec's forward error costs training for its bias
    (shrinkage, deleted directions) or for its power alone. Not with GSPO (its two forwards would differ)."""

    def validate(self, boundary) -> None:
        if not 0 < self.bits <= 8 or not 0 < self.context_bits <= 8 or not 0 < self.bwd_tokens <= 1:
            raise ValueError("boundary.klt.bits and boundary.klt.context_bits must be in (0, 8] bits per dim and "
                             f"boundary.klt.bwd_tokens in (0, 1], got {self.bits}, {self.context_bits} and "
                             f"{self.bwd_tokens}")
        if self.basis_dtype not in ("bfloat16", "int8"):
            raise ValueError(f"boundary.klt.basis_dtype must be bfloat16 or int8, got {self.basis_dtype!r}")
        if self.scale not in ("width", "token") or self.bwd_select not in BWD_SELECTS:
            raise ValueError(f"boundary.klt.scale must be width or token and bwd_select one of {BWD_SELECTS}, got "
                             f"{self.scale!r} and {self.bwd_select!r}")
        if self.channels < 0 or self.refresh_every < 0:
            raise ValueError(f"boundary.klt.channels and boundary.klt.refresh_every must be >= 0, got "
                             f"{self.channels} and {self.refresh_every}")
        if boundary.kind == self.name and not _power_of_two(boundary.quant_group or 1):
            raise ValueError(f"boundary.quant_group must be a power of two for klt (its backward's Hadamard tiles), "
                             f"got {boundary.quant_group}")


@register_boundary
@dataclass(kw_only=True, slots=True)
class KltDitherKind(BoundaryKind):
    """``klt-dither`` (not in the papers; issue 52): ``klt``'s basis with an unbiased, entropy-coded forward: each
    KLT component quantised on a uniform grid with subtractive dither drawn from the boundary's PRF (never sent;
    the error uniform and independent of the signal), the indices entropy coded (ANS, ``boundary/entropy_code.py``),
    steps by reverse water-filling on the coder's own rate; ``[boundary.klt-dither]``. Its backward is ``klt``'s."""
    name = "klt-dither"
    default_bits = (0, 1)
    bits: float = 3.5
    """Forward bits per hidden dim, on average, of a token whose output is scored: the entropy the steps are chosen
    for (the coder's model of a unit Gaussian; real activations' heavier tails cost a little more, metered)."""
    context_bits: float = 2.0
    """The same for every other token (prompt, padding)."""
    channels: int = 4
    """Channels sent intact in bf16 (``klt``'s)."""
    bwd_tokens: float = 0.5
    """Fraction of a microbatch's tokens whose activation gradient is sent back (``klt``'s backward)."""
    bwd_select: str = "top"
    """Which ``bwd_tokens`` share crosses (boundary/token_sample.py): ``top`` (the largest gradient norms;
    biased: a token with small gradients never reaches the stages before it) or ``sample`` (each token with
    probability ~ its norm, capped at 1, scaled by the inverse in its per-token scale: unbiased, the same bytes)."""
    basis_dtype: str = "int8"
    """The start's basis on the wire: ``int8`` (one bf16 step per column) or ``bfloat16``."""
    dither: bool = True
    """Subtractive dither (unbiased; issue 52 item 2). False: plain entropy-coded uniform steps (ECSQ, deterministic;
    item 3), whose coarsest steps round small components to 0 as Lloyd-Max's do."""

    def validate(self, boundary) -> None:
        if not 0 < self.bits <= 8 or not 0 < self.context_bits <= 8 or not 0 < self.bwd_tokens <= 1:
            raise ValueError("boundary.klt-dither.bits and context_bits must be in (0, 8] bits per dim and bwd_tokens "
                             f"in (0, 1], got {self.bits}, {self.context_bits} and {self.bwd_tokens}")
        if self.basis_dtype not in ("bfloat16", "int8") or self.channels < 0 or self.bwd_select not in BWD_SELECTS:
            raise ValueError("boundary.klt-dither.basis_dtype must be bfloat16 or int8, channels >= 0 and bwd_select "
                             f"one of {BWD_SELECTS}, got {self.basis_dtype!r}, {self.channels} and {self.bwd_select!r}")


@register_boundary
@dataclass(kw_only=True, slots=True)
class SsnKind(BoundaryKind):
    """``ssn``: Subspace Networks, a fixed shared basis of ``boundary.rank`` dims and confined weights (MAPL App.
    A); part of the model; ``[boundary.ssn]``."""
    name = "ssn"
    architectural = True
    flat_prefix = "ssn_"
    needs_model = "its basis is built from the model's token embedding"
    refresh_every: int = 500
    """Grassmann refresh of the shared basis every N steps (Table 8: 500; 0 = never)."""
    refresh_lr: float = 0.01
    """Grassmann step size (Table 8: 1e-2)."""

    def validate(self, boundary) -> None:
        if self.refresh_every < 0 or self.refresh_lr < 0:
            raise ValueError("boundary.ssn.refresh_every and boundary.ssn.refresh_lr must be >= 0")


@register_boundary
@dataclass(kw_only=True, slots=True)
class MaplKind(BoundaryKind):
    """``mapl``: a learned Stiefel projector of ``boundary.rank`` dims + per-stage offsets (MAPL §3.2); part of the
    model (``boundary.projector_*``, ``offset``, ``init`` are its settings, shared with ``mapl-vq``)."""
    name = "mapl"
    architectural = True
    needs_model = "its projector and offsets are built from the model's embedding (docs/mapl.md)"


@register_boundary
@dataclass(kw_only=True, slots=True)
class MaplVQKind(BoundaryKind):
    """``mapl-vq``: MAPL + residual VQ with streaming codebooks (MAPL §3.5); ``[boundary.mapl-vq]``."""
    name = "mapl-vq"
    architectural = True
    flat_prefix = "vq_"
    needs_model = "its projector is built from the model's embedding and its bytes depend on its codebooks " \
        "(docs/mapl.md)"
    codes: int = 256
    """Codes K per codebook (Table 8: 256)."""
    rounds: int = 2
    """Residual rounds R (Table 8: 2)."""
    group_size: int = 2
    """Dims per quantised group g (Table 8: G = 2); ``boundary.rank`` must be a multiple."""
    sync_codes: int = 1
    """Codebook slots streamed per microbatch and direction (§3.5: 1/K of the codebook)."""
    decay: float = 0.95
    """EMA decay of the k-means codebook updates."""

    def validate(self, boundary) -> None:
        if self.group_size < 1 or not 2 <= self.codes or self.rounds < 1 or not 1 <= self.sync_codes <= self.codes:
            raise ValueError("boundary.mapl-vq.codes must be >= 2, rounds >= 1, group_size >= 1 and "
                             "1 <= sync_codes <= codes")
        if not 0 <= self.decay < 1:
            raise ValueError(f"boundary.mapl-vq.decay must be in [0, 1), got {self.decay}")
        if boundary.kind == self.name and boundary.rank % self.group_size:
            raise ValueError(f"boundary.rank = {boundary.rank} must be a multiple of boundary.mapl-vq.group_size = "
                             f"{self.group_size}")
