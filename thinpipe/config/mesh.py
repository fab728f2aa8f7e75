"""Where it runs: the process mesh (``[mesh]``) and the shaped links between ranks (``[link]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thinpipe.config.errors import ConfigError


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
