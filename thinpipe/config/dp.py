"""Data-parallel synchronisation of the fast replicas: the ``[dp]`` section."""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError
from thinpipe.plugins import PLUGIN_DP_SCHEMES

DP_KINDS = ("allreduce", "powersgd", "diloco", "streaming-diloco")  # the built-in schemes (dp/registry.py: BUILTIN)


@dataclass(kw_only=True, slots=True)
class DPConfig:
    kind: str = "allreduce"
    """DP synchronisation of the fast replicas (each stage's replicas form one DP group):
    ``allreduce`` (exact gradient average every step), ``powersgd`` (low-rank gradient average
    every step), ``diloco`` (H inner steps, then an outer Nesterov step on the averaged
    pseudo-gradient, PowerSGD-compressed when ``dp.rank`` > 0), ``streaming-diloco`` (DiLoCo in
    fragments, staggered and overlapped), or a kind a plugin registered (``plugins.py:
    register_dp_scheme``)."""
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
        if self.kind not in DP_KINDS and self.kind not in PLUGIN_DP_SCHEMES:
            raise ConfigError(f"dp.kind = {self.kind!r} is unknown: choose one of "
                              f"{', '.join(DP_KINDS + tuple(PLUGIN_DP_SCHEMES))}")
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
