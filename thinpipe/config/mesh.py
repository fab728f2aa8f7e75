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
    split: list[int] | str = field(default_factory=list)
    """Decoder layers per stage: a list, e.g. ``[8, 7, 7, 8]``; empty = balanced; ``"auto"``: chosen at the start
    from what each rank measures (a decoder layer's forward + backward at the run's shapes, its free memory:
    ``models/auto_split.py``), the least slowest-stage time; the run's ``config.toml`` then holds the list chosen."""
    speeds: list[float] = field(default_factory=list)
    """Relative compute speed per stage (the simulation's ``split = "auto"``; e.g. ``[1.0, 1.0, 0.5, 1.0]``: the
    third stage's machine at half speed); empty = equal. Real ranks measure theirs instead."""
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
        if isinstance(self.split, str):
            if self.split != "auto":
                raise ConfigError(f"mesh.split must be a list of layer counts or \"auto\", got {self.split!r}")
        elif self.split:
            if len(self.split) != self.pp:
                raise ConfigError(
                    f"mesh.split has {len(self.split)} entries but mesh.pp = {self.pp}: give one layer count per stage")
            if any(n < 1 for n in self.split):
                raise ConfigError(f"mesh.split entries must be >= 1 layer each, got {self.split}")
        if any(not v > 0 for v in self.speeds):
            raise ConfigError(f"mesh.speeds must be > 0 each (relative speeds), got {self.speeds}")

    @property
    def fixed_split(self) -> list[int] | None:
        """The layers per stage when they are fixed by the config (None: balanced, or ``auto`` not chosen yet)."""
        return list(self.split) if isinstance(self.split, list) and self.split else None

@dataclass(kw_only=True, slots=True)
class LinkConfig:
    pp_mbps: float | list[float] = 0.0
    """Bandwidth of the PP links (each direction of each stage pair), Mbit/s; 0 = unshaped. One number for every
    boundary, or a list with one per boundary (``[200, 40, 200]``: the link between stages 1 and 2 at 40). The
    distributed engine enforces it in the transport (token bucket); the simulation ignores it."""
    pp_latency_ms: float | list[float] = 0.0
    """One-way latency added to every PP message, ms: one number, or one per boundary."""
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
            value = getattr(self, name)
            if any(v < 0 for v in (value if isinstance(value, list) else [value])):
                raise ConfigError(f"link.{name} must be >= 0 (0 = unshaped), got {value}")

    def check_boundaries(self, boundaries: int) -> None:
        """A per-boundary list has one entry per boundary (``mesh.pp - 1``)."""
        for name in ("pp_mbps", "pp_latency_ms"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != boundaries:
                raise ConfigError(f"link.{name} lists {len(value)} values but the pipeline has {boundaries} "
                                  f"boundar{'y' if boundaries == 1 else 'ies'} (mesh.pp - 1): give one per boundary, "
                                  "or one number for all")

    def pp_mbps_at(self, boundary: int) -> float:
        """Boundary ``boundary``'s bandwidth, Mbit/s (0: unshaped)."""
        return self.pp_mbps[boundary] if isinstance(self.pp_mbps, list) else self.pp_mbps

    def pp_latency_ms_at(self, boundary: int) -> float:
        return self.pp_latency_ms[boundary] if isinstance(self.pp_latency_ms, list) else self.pp_latency_ms

    @property
    def pp_mbps_min(self) -> float:
        """The slowest PP link's bandwidth (0: some link unshaped... or all)."""
        return min(self.pp_mbps) if isinstance(self.pp_mbps, list) else self.pp_mbps
