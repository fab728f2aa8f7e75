"""The anchor circuit (``[anchor]``) and the optimizers around the inner step (``[optim]``: the
spectral correction it feeds, Muon)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thinpipe.config.errors import ConfigError


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
