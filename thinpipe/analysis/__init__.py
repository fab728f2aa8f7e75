"""Boundary analyses of MAPL §3.1, §3.4 and App. D: spectra, angles, energy, isometry, stable rank; and how fast a
compressed run learns against Dense (issue 52: ``learning_ratio``)."""

from thinpipe.analysis.learning import learning_ratio
from thinpipe.analysis.subspace import (
    captured_energy,
    cosine_preservation,
    cumulative_energy,
    energy_vs_fixed,
    principal_angle_deg,
    stable_rank,
)

__all__ = ["captured_energy", "cosine_preservation", "cumulative_energy", "energy_vs_fixed", "learning_ratio",
           "principal_angle_deg", "stable_rank"]
