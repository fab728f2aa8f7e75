"""Typed, validated run configuration.

One dataclass per component, each field documented by the string literal below it. A config is
built from defaults, then a TOML file, then dotted ``--set key=value`` overrides; every step is
validated so that a bad input fails with one clear ``ConfigError`` before any heavy work.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w


class ConfigError(ValueError):
    """A user error in the configuration; the message says what is wrong and how to fix it."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "smollm2-135m"
    """Model: a preset (``smollm2-135m``, ``tiny-llama``, ``tiny-qwen2``), a folder with a Hugging
    Face ``config.json`` + safetensors, or a ``.gguf`` file."""

    tied: str = "sync"
    """Tied input/output embeddings split over stages: ``sync`` sums the two copies' gradients every
    step (exact; costs V x H values each way on the ``tied`` axis), ``untie`` lets them drift apart."""

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("model.name is empty: give a preset (smollm2-135m, tiny-llama, tiny-qwen2) or a path")
        if self.tied not in ("sync", "untie"):
            raise ConfigError(f"model.tied must be sync or untie, got {self.tied!r}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    name: str = "math"
    """Training corpus from the registry: ``math``, ``medical`` or ``synthetic``."""
    max_examples: int = 0
    """Read at most this many training examples (0 = all); for quick runs."""
    val_rows: int = 16
    """Packed held-out rows used for validation loss (0 = the whole held-out split)."""

    def validate(self) -> None:
        if self.max_examples < 0:
            raise ConfigError(f"data.max_examples must be >= 0 (0 = all), got {self.max_examples}")
        if self.val_rows < 0:
            raise ConfigError(f"data.val_rows must be >= 0 (0 = all), got {self.val_rows}")


@dataclass(kw_only=True, slots=True)
class MeshConfig:
    pp: int = 1
    """Pipeline stages: the model's layers are split into this many contiguous ranges."""
    dp: int = 1
    """Fast-circuit data-parallel replicas; each trains on its own data shard."""
    split: list[int] = field(default_factory=list)
    """Explicit decoder layers per stage, e.g. ``[8, 7, 7, 8]`` (empty = balanced)."""
    anchor: int = 0
    """Anchor-circuit replicas (0 or 1): unmasked passes on stale weights feeding the spectral
    correction (paper §3.2)."""

    def validate(self) -> None:
        if self.anchor not in (0, 1):
            raise ConfigError(f"mesh.anchor must be 0 or 1 (the paper fixes Z = 1), got {self.anchor}")
        if self.pp < 1:
            raise ConfigError(f"mesh.pp must be >= 1, got {self.pp}")
        if self.dp < 1:
            raise ConfigError(f"mesh.dp must be >= 1, got {self.dp}")
        if self.split:
            if len(self.split) != self.pp:
                raise ConfigError(
                    f"mesh.split has {len(self.split)} entries but mesh.pp = {self.pp}: give one layer count per stage")
            if any(n < 1 for n in self.split):
                raise ConfigError(f"mesh.split entries must be >= 1 layer each, got {self.split}")


BOUNDARY_KINDS = ("identity", "mask", "topk", "ssn", "mapl", "mapl-vq", "quant4", "quant2", "aqsgd", "tahquant",
                  "bottleneck")
ARCHITECTURAL_KINDS = ("ssn", "mapl", "mapl-vq", "bottleneck")
# (forward, backward) bits of the quantising kinds when boundary.fwd_bits / bwd_bits are 0:
# Table 4's 4-bit Quant (4x against a 16-bit wire) and AQ-SGD / TAH-Quant at "8/2x".
QUANT_BITS = {"quant4": (4, 4), "quant2": (2, 2), "aqsgd": (2, 8), "tahquant": (2, 8)}  # part of the model: training and evaluation run through them


@dataclass(kw_only=True, slots=True)
class BoundaryConfig:
    kind: str = "identity"
    """PP boundary compressor: ``identity`` (dense), ``mask`` (PRF random activation masking, §3.1),
    ``topk`` (the K largest-magnitude dims per token, indices sent; App. F's biased baseline),
    ``ssn`` (Subspace Networks: fixed shared basis, confined weights; MAPL App. A), ``mapl`` (learned
    Stiefel projector + stage anchors; MAPL §3.2) or ``mapl-vq`` (MAPL + residual VQ; §3.5); the
    activation-compression baselines of anchor-priors Table 4: ``quant4`` / ``quant2`` (uniform
    4 / 2-bit), ``aqsgd`` (AQ-SGD: quantised change against a per-example buffer), ``tahquant``
    (tile-wise adaptive Hadamard quantisation) and ``bottleneck`` (a learned linear down/up pair
    of K = (1-p) H dims). docs/baselines.md has each one's details."""
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
    anchor: str = "factorized"
    """MAPL per-stage anchor (Table 6): ``factorized`` (E_small P), ``full`` (a V x d table per
    stage), ``static`` (the frozen token embedding) or ``none``."""
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
    ssn_refresh_every: int = 500
    """``ssn``: Grassmann refresh of the shared basis every N steps (Table 8: 500; 0 = never)."""
    ssn_refresh_lr: float = 0.01
    """``ssn``: Grassmann step size (Table 8: 1e-2)."""

    def bits(self) -> tuple[int, int]:
        """(forward, backward) bits of a quantising kind, defaults filled in."""
        fwd, bwd = QUANT_BITS.get(self.kind, (0, 0))
        return self.fwd_bits or fwd, self.bwd_bits or bwd

    def validate(self) -> None:
        if self.kind not in BOUNDARY_KINDS:
            raise ConfigError(f"boundary.kind = {self.kind!r} is unknown: choose one of {', '.join(BOUNDARY_KINDS)}")
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
        if self.anchor not in ("factorized", "full", "static", "none"):
            raise ConfigError(f"boundary.anchor must be factorized, full, static or none, got {self.anchor!r}")
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
        if self.ssn_refresh_every < 0 or self.ssn_refresh_lr < 0:
            raise ConfigError("boundary.ssn_refresh_every and boundary.ssn_refresh_lr must be >= 0")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (anchor-priors §6); 0 = full fine-tuning, > 0 trains only peft adapters."""
    alpha: float = 16.0
    """LoRA alpha: the adapter update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps runs bitwise repeatable)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names that get adapters (default: every linear map of the decoder layers)."""

    def validate(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"train.lora needs rank >= 0, alpha > 0 and 0 <= dropout < 1, got {self.rank}, "
                              f"{self.alpha}, {self.dropout}")
        if self.rank and not self.target_modules:
            raise ConfigError("train.lora.target_modules is empty: name the modules to adapt, e.g. [\"q_proj\"]")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 4
    """Sequences per step per fast replica (split into ``microbatches``)."""
    seq_len: int = 256
    """Tokens per packed sequence."""
    microbatches: int = 1
    """Microbatches per step; must divide batch_size."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe`` or ``1f1b`` (same numerics; they differ in memory and bubbles)."""
    lr: float = 2e-5
    """Peak learning rate (paper App. I.3: 2e-5)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to this fraction of lr (App. I.3: 0.1)."""
    warmup_ratio: float = 0.03
    """Fraction of steps of linear warm-up (App. I.3: 3%)."""
    grad_clip: float = 0.2
    """Global gradient-norm clip (App. I.3: 0.2); 0 disables."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1 (App. I.3)."""
    beta2: float = 0.999
    """AdamW beta2 (App. I.3)."""
    seed: int = 0
    """Seed for initialisation, data order and the masking PRF."""
    dtype: str = "float32"
    """Parameter and activation dtype: ``float32`` or ``bfloat16``."""
    checkpoint_every: int = 50
    """Write a resumable checkpoint (atomically) every N steps and at the end (0 = only at the end)."""
    optimizer: str = "adamw"
    """``adamw`` for every parameter, or ``muon``: Muon (Polar Express) for the decoder layers' 2-D
    weights at train.lr and AdamW for the rest at optim.muon.adam_lr_scale x train.lr (MAPL App. E.3)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters via peft (train.lora.rank > 0 turns them on)."""

    def validate(self) -> None:
        self.lora.validate()
        for name in ("steps", "batch_size", "seq_len", "microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.microbatches = {self.microbatches} does not divide train.batch_size = {self.batch_size}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"train.schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"train.optimizer must be adamw or muon, got {self.optimizer!r}")


DP_KINDS = ("allreduce", "powersgd", "diloco", "streaming-diloco")


@dataclass(kw_only=True, slots=True)
class DPConfig:
    kind: str = "allreduce"
    """DP synchronisation of the fast replicas (each stage's replicas form one DP group):
    ``allreduce`` (exact gradient average every step), ``powersgd`` (low-rank gradient average
    every step) or ``diloco`` (H inner steps, then an outer Nesterov step on the averaged
    pseudo-gradient, PowerSGD-compressed when ``dp.rank`` > 0)."""
    rank: int = 0
    """PowerSGD rank: for ``powersgd`` the gradient's (0 means 4); for ``diloco`` and
    ``streaming-diloco`` the outer pseudo-gradient's (0 = uncompressed outer average)."""
    start_step: int = 10
    """PowerSGD averages uncompressed before this many averages (PyTorch's start_powerSGD_iter)."""
    inner_steps: int = 10
    """DiLoCo H: inner steps between outer steps (the paper uses 10)."""
    outer_lr: float = 0.7
    """DiLoCo outer SGD learning rate."""
    outer_momentum: float = 0.9
    """DiLoCo outer Nesterov momentum."""
    fragments: int = 1
    """Streaming DiLoCo F: fragments strided over layers, synced on a staggered schedule."""
    overlap: int = 0
    """Streaming DiLoCo tau: inner steps between posting a fragment's outer all-reduce and applying it."""
    alpha: float = 0.5
    """Streaming DiLoCo mixing on arrival: local <- alpha local + (1 - alpha) global_new."""
    quantize: bool = False
    """Streaming DiLoCo: exchange outer gradients as int8 with per-row scales (all-gather)."""

    def validate(self) -> None:
        if self.kind not in DP_KINDS:
            raise ConfigError(f"dp.kind = {self.kind!r} is unknown: choose one of {', '.join(DP_KINDS)}")
        if self.rank < 0:
            raise ConfigError(f"dp.rank must be >= 0, got {self.rank}")
        if self.quantize and self.rank:
            raise ConfigError("dp.quantize and dp.rank > 0 are two outer-gradient compressors: choose one")
        if self.start_step < 0:
            raise ConfigError(f"dp.start_step must be >= 0, got {self.start_step}")
        if self.inner_steps < 1:
            raise ConfigError(f"dp.inner_steps must be >= 1, got {self.inner_steps}")
        if self.fragments < 1 or self.fragments > self.inner_steps:
            raise ConfigError(f"dp.fragments must be in [1, dp.inner_steps = {self.inner_steps}], got {self.fragments}")
        if not 0 <= self.overlap < self.inner_steps:
            raise ConfigError(f"dp.overlap must be in [0, dp.inner_steps), got {self.overlap}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"dp.alpha must be in [0, 1], got {self.alpha}")
        if self.quantize and self.kind != "streaming-diloco":
            raise ConfigError("dp.quantize applies to dp.kind = streaming-diloco only")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"dp.outer_lr must be > 0 and dp.outer_momentum in [0, 1), got "
                              f"{self.outer_lr}, {self.outer_momentum}")


@dataclass(kw_only=True, slots=True)
class AnchorConfig:
    staleness: int = 20
    """delta: fast steps between an anchor pass on snapshot w_t and the delivery of its gradient."""
    every: int = 0
    """Start a new anchor cycle every N fast steps (0 = every ``staleness`` steps: one replica
    finishing one pull-pass-push cycle per delta steps, the paper's regime)."""
    mix: float = 0.0
    """Variant (not in the paper): also add ``mix`` x the stale anchor gradient to the update at
    its arrival step, as asynchronous SGD would. 0 = the paper's method."""
    push_rank: int = 0
    """Compress the pushed anchor gradient with PowerSGD at this rank (error feedback, warm-started
    Q; App. H.2: "compressed to roughly the volume of one DP all-reduce payload"); 0 = dense."""
    delivery: str = "fixed"
    """When a fast replica consumes a prior on the real mesh (``--engine dist``): ``fixed`` = at
    exactly produced step + ``staleness`` (as the simulation does; a late prior is waited for and
    the wait is reported), ``arrival`` = at the first step after it has arrived (never waits; the
    realised staleness is whatever the anchor's speed gives). The simulation is always ``fixed``."""

    def validate(self) -> None:
        if self.delivery not in ("fixed", "arrival"):
            raise ConfigError(f"anchor.delivery must be fixed or arrival, got {self.delivery!r}")
        if self.staleness < 1:
            raise ConfigError(f"anchor.staleness must be >= 1 fast step, got {self.staleness}")
        if self.every < 0:
            raise ConfigError(f"anchor.every must be >= 0 (0 = anchor.staleness), got {self.every}")
        if self.mix < 0:
            raise ConfigError(f"anchor.mix must be >= 0, got {self.mix}")
        if self.push_rank < 0:
            raise ConfigError(f"anchor.push_rank must be >= 0 (0 = dense push), got {self.push_rank}")


@dataclass(kw_only=True, slots=True)
class SpectralConfig:
    tau: float = 1e-3
    """Filter strength: d_i = s_i / (s_i + tau) (Table 2 default 1e-3)."""
    alpha: float = 0.3
    """Blend: G = alpha G_mask + (1 - alpha) G_filt (Table 2 default 0.3; 1 = no correction)."""
    beta: float = 0.9
    """EMA decay of the anchor momentum, applied per arrival (not given in the paper)."""
    rank: int = 64
    """SVD rank kept per matrix: full SVD when min(m, n) <= rank, else seeded randomized rank-r."""
    relative_tau: bool = False
    """Read tau relative to the top singular value s_1 (scale-free) instead of absolute."""
    bias_correction: bool = False
    """Variant: divide the anchor momentum by 1 - beta^k after k arrivals."""

    def validate(self) -> None:
        if self.tau <= 0:
            raise ConfigError(f"optim.spectral.tau must be > 0, got {self.tau}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"optim.spectral.alpha must be in [0, 1], got {self.alpha}")
        if not 0 <= self.beta < 1:
            raise ConfigError(f"optim.spectral.beta must be in [0, 1), got {self.beta}")
        if self.rank < 1:
            raise ConfigError(f"optim.spectral.rank must be >= 1, got {self.rank}")


@dataclass(kw_only=True, slots=True)
class MuonConfig:
    momentum: float = 0.95
    """Muon momentum (MAPL Table 7: 0.95), Nesterov."""
    adam_lr_scale: float = 0.5
    """AdamW learning rate of the non-matrix parameters as a multiple of train.lr (MAPL Table 8: 0.5)."""
    ns_steps: int = 5
    """Polar Express iterations per update."""

    def validate(self) -> None:
        if not 0 <= self.momentum < 1 or self.adam_lr_scale <= 0 or self.ns_steps < 1:
            raise ConfigError("optim.muon needs 0 <= momentum < 1, adam_lr_scale > 0 and ns_steps >= 1, got "
                              f"{self.momentum}, {self.adam_lr_scale}, {self.ns_steps}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    spectral: SpectralConfig = field(default_factory=SpectralConfig)
    """Spectral correction around the inner optimizer; active when mesh.anchor = 1."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon settings, used when train.optimizer = muon."""

    def validate(self) -> None:
        self.spectral.validate()
        self.muon.validate()


@dataclass(kw_only=True, slots=True)
class LinkConfig:
    pp_mbps: float = 0.0
    """Bandwidth of every PP link (each direction of each stage pair), Mbit/s; 0 = unshaped. The
    distributed engine enforces it in the transport (token bucket); the simulation ignores it."""
    pp_latency_ms: float = 0.0
    """One-way latency added to every PP message, ms."""
    dp_mbps: float = 0.0
    """Bandwidth of each rank's DP link, Mbit/s (a ring all-reduce moves 2 (n-1)/n of the tensor)."""
    dp_latency_ms: float = 0.0
    """Latency per ring hop of a DP collective, ms (2 (n-1) hops per all-reduce)."""
    shaper: str = "transport"
    """Who enforces the bandwidths: ``transport`` (a token bucket in the sending process, no root
    needed) or ``kernel`` (tc qdiscs between network namespaces; set by ``thinpipe launch --netns``,
    which builds them). Latency is added by the transport either way."""

    def validate(self) -> None:
        if self.shaper not in ("transport", "kernel"):
            raise ConfigError(f"link.shaper must be transport or kernel, got {self.shaper!r}")
        for name in ("pp_mbps", "pp_latency_ms", "dp_mbps", "dp_latency_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"link.{name} must be >= 0 (0 = unshaped), got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class DiagConfig:
    every: int = 0
    """Every N steps, also compute the clean (unmasked) gradient at the same weights and batch and
    log its cosine with the masked and the corrected gradient (costs one extra pass; 0 = off)."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"diag.every must be >= 0, got {self.every}")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Validation loss every N steps (0 = only at the start and the end)."""
    tasks: list[str] = field(default_factory=list)
    """Multiple-choice tasks run after training (e.g. ``["arc_easy"]``); empty = none."""
    limit: int = 100
    """Items per multiple-choice task."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        if self.limit < 1:
            raise ConfigError(f"eval.limit must be >= 1, got {self.limit}")


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    boundary: BoundaryConfig = field(default_factory=BoundaryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.boundary.kind in ARCHITECTURAL_KINDS:
            if self.boundary.masked:
                raise ConfigError(f"boundary.kind = {self.boundary.kind} applies to every boundary (its stage "
                                  "anchors chain through them): leave boundary.masked empty")
            if self.mesh.anchor:
                raise ConfigError(f"mesh.anchor = 1 runs dense passes of the model, but boundary.kind = "
                                  f"{self.boundary.kind} is part of the model: use mask/topk with the anchor circuit")
            if self.diag.every:
                raise ConfigError(f"diag.every compares with the unmasked gradient, which boundary.kind = "
                                  f"{self.boundary.kind} (part of the model) does not have: set diag.every = 0")
        if self.boundary.masked and max(self.boundary.masked) >= self.mesh.pp - 1:
            raise ConfigError(
                f"boundary.masked = {self.boundary.masked} names a boundary that does not exist: with mesh.pp = "
                f"{self.mesh.pp} the boundaries are 0..{self.mesh.pp - 2}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a TOML value or a ``--set`` string to the field's declared type."""
    typ = str(typ)
    if isinstance(value, str) and typ != "str":
        text = value.strip()
        if typ == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key} expects true or false, got {value!r}")
        if typ.startswith("list"):
            text = text.strip("[]")
            value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
        else:
            value = text
    try:
        if typ == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ == "bool":
            if not isinstance(value, bool):
                raise ValueError
            return value
        if typ == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
        if typ == "list[int]":
            return [int(v) for v in value]
        if typ == "list[str]":
            return [str(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{key} expects a value of type {typ}, got {value!r}") from None
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(options)})"


def apply_overrides(cfg: Config, values: dict[str, Any], source: str = "--set") -> Config:
    """Apply ``{"section.key": value}`` (flat, dotted, nested sections allowed) overrides in place, type-checked."""
    for dotted, value in values.items():
        if "." not in dotted:
            raise ConfigError(f"{source}: key {dotted!r} must be dotted as section.key, e.g. train.steps")
        obj, parts = cfg, dotted.split(".")
        for i, part in enumerate(parts):
            fields = {f.name: f for f in dataclasses.fields(obj)}
            if part not in fields:
                where = ".".join(parts[:i])
                what = f"key {dotted!r}" if where else f"section {part!r}"
                raise ConfigError(f"{source}: unknown {what}{_suggest(part, list(fields))}")
            if i == len(parts) - 1:
                if dataclasses.is_dataclass(getattr(obj, part)):
                    raise ConfigError(f"{source}: {dotted!r} is a section; set one of its keys, e.g. {dotted}."
                                      f"{dataclasses.fields(getattr(obj, part))[0].name}")
                setattr(obj, part, _coerce(value, fields[part].type, dotted))
            else:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise ConfigError(f"{source}: {'.'.join(parts[:i + 1])!r} is a value, not a section")
    return cfg


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config(path: str | Path | None = None, sets: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``key=value`` strings; validated."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found: check the path given to --config")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        apply_overrides(cfg, _flatten(data), source=str(path))
    overrides: dict[str, Any] = {}
    for item in sets or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value, e.g. --set train.steps=10")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    apply_overrides(cfg, overrides)
    return cfg.validate()
