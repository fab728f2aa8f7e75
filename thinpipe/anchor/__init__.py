"""The anchor circuit: unmasked passes on stale weights, delivered as anchor priors (paper §3.2, App. H)."""

from thinpipe.anchor.sim_circuit import AnchorPrior, SimAnchorCircuit

__all__ = ["AnchorPrior", "SimAnchorCircuit"]
