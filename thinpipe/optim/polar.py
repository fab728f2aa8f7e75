"""Polar Express: the orthogonal polar factor of a matrix by composed odd quintics (Amsel et al.,
ICLR 2026; MAPL §3.3, App. E.3, Table 8).

For G = U S V^T, ``polar_express(G, steps)`` approximates U V^T. Each iteration applies
p_k(X) = a_k X + b_k (X X^T) X + c_k (X X^T)^2 X with coefficients chosen per iteration
(minimax-optimal for the singular-value interval the previous iterations leave), so the first
steps inflate small singular values fast and the last ones converge like Newton-Schulz. MAPL uses
5 steps for the SPEL direction (an LMO: roughly orthogonal is enough, as in Muon) and 7 for the
retraction onto St(d, r) (which must be orthonormal to ~1e-5: see tests/unit/optim/test_stiefel.py).

The coefficient table is the published degree-5 schedule for l = 1e-3 with the paper's safety
factor 1.01 (all but the last, fixed-point polynomial are divided by 1.01, 1.01^3, 1.01^5).
"""

from __future__ import annotations

import torch

_RAW = [(8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375)]
COEFFICIENTS = [(a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in _RAW[:-1]] + [_RAW[-1]]


def polar_express(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonal polar factor U V^T of a 2-D ``G`` (m, n), in G's dtype.

    Works on the wide orientation (fewer rows) so the Gram matrix is the small one; the input is
    scaled by 1.01 ||G||_F so every singular value starts in (0, 1]. Steps beyond the table repeat
    the last (Newton-Schulz fixed-point) polynomial."""
    if G.ndim != 2:
        raise ValueError(f"polar_express needs a matrix, got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"polar_express needs at least 1 step, got {steps}")
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / (X.norm() * 1.01 + eps)
    for k in range(steps):
        a, b, c = COEFFICIENTS[min(k, len(COEFFICIENTS) - 1)]
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X
