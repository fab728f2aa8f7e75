"""Which tokens' activation gradients a token-sparse backward sends (``bwd_tokens`` = f < 1; issue 52).

Two rules, both sending exactly K = ceil(f N) of a microbatch's N tokens and a bitmap naming them:

- ``top``: the K tokens with the largest gradient norm. Deterministic and *biased*: a token whose gradient is
  often small never reaches the stages before it. Trained, T50 (half the tokens) cost ~0.4 points of held-out
  loss against T100 on three seeds (experiments/frontier/README.md), while its gradient cosine at the start was
  unchanged (0.597 vs 0.604): the same signature as the forward's bias that issue 52's diagnosis measured.
- ``sample``: an unbiased estimate of the whole gradient (Horvitz-Thompson). Token i is kept with probability
  pi_i = min(1, c ||g_i||), c such that sum_i pi_i = K (the capped probability-proportional-to-size design,
  the variance-optimal one for a sum of vectors under a fixed sample size), by systematic sampling: K points
  u, u + 1, ..., u + K - 1 on the cumulative pi, one uniform u per microbatch, so exactly K tokens and each with
  probability exactly pi_i. A kept token is sent as g_i / pi_i, which rides in the per-token scale the codes
  already carry: no byte more. E[sent] = g. The heavy tokens (pi = 1) cross as under ``top``; the light ones
  stand for their neighbours. Measured (experiments/frontier/README.md, "toward 10x"): no better than ``top`` on
  two paired seeds (+1.55 / +2.50% against +1.74 / +1.96%): its variance costs what the bias did. ``top`` is the
  default.

u comes from the boundary's PRF (``prf.prf_key`` of seed, boundary, step, microbatch, replica): only the sender
draws it, but a crash + resume and dist == sim see the same tokens.
"""

from __future__ import annotations

import math

import torch

from thinpipe.boundary.prf import prf_key
from thinpipe.config.boundary_kinds import BWD_SELECTS as SELECTS

_BWD_STREAM = 2  # the PRF stream of the backward's draw (the forward's dither uses 0 and 1)


def inclusion(weights: torch.Tensor, k: int) -> torch.Tensor:
    """pi_i = min(1, c w_i) with sum_i pi_i = ``k`` (float64; ``weights`` >= 0 with more than ``k`` positive).

    The capped tokens are the m largest, m the least count for which the rest's proportional shares are all
    below 1: (k - m) w_(m) <= sum of the weights after the m largest (w sorted descending)."""
    w = weights.double()
    order = w.argsort(descending=True, stable=True)
    ws = w[order]
    after = ws.flip(0).cumsum(0).flip(0)  # after[m] = sum of ws[m:]
    m_all = torch.arange(k, device=w.device, dtype=torch.float64)
    fits = (k - m_all) * ws[:k] <= after[:k] * (1 + 1e-12)
    m = int(fits.to(torch.int64).argmax()) if bool(fits.any()) else k
    pi = torch.empty_like(w)
    pi[order[:m]] = 1.0
    rest = order[m:]
    pi[rest] = ((k - m) * ws[m:] / after[m]).clamp(max=1.0)
    return pi


def systematic(pi: torch.Tensor, u: float) -> torch.Tensor:
    """A bool mask of exactly round(sum pi) tokens: token i is kept when a point u + j (j = 0, 1, ...) falls in
    its interval [C_{i-1}, C_i) of the cumulative sum C of ``pi``; over u ~ U[0, 1) each i with probability pi_i."""
    k = round(float(pi.sum()))
    edges = pi.cumsum(0)
    edges[-1] = float(k)  # the last edge exactly K: no point falls past it through rounding
    points = u + torch.arange(k, dtype=torch.float64, device=pi.device)
    hit = torch.searchsorted(edges, points, right=True).clamp(max=pi.numel() - 1)
    keep = torch.zeros(pi.numel(), dtype=torch.bool, device=pi.device)
    keep[hit] = True
    short = k - int(keep.sum())
    if short:  # two points in one interval: only when rounding made a pi_i exceed 1 (never seen); stay at K
        free = torch.where(~keep, pi, torch.full_like(pi, -1.0))
        keep[free.topk(short).indices] = True
    return keep


def select_tokens(sq_norms: torch.Tensor, kept: int, how: str,
                  key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep mask of exactly ``kept`` tokens, the factor each kept token's gradient is multiplied by before it is
    coded: 1 under ``top``, 1 / pi_i under ``sample``). ``key``: the PRF's (seed, boundary, step, microbatch,
    replica)."""
    if how not in SELECTS:
        raise ValueError(f"token selection must be one of {SELECTS}, got {how!r}")
    n = sq_norms.numel()
    ones = torch.ones(n, dtype=torch.float32, device=sq_norms.device)
    if how == "top" or kept >= n or int((sq_norms > 0).sum()) <= kept:
        # every token with a gradient fits (or the rule is top): the largest K, none scaled (unbiased when all fit)
        keep = torch.zeros(n, dtype=torch.bool, device=sq_norms.device)
        keep[sq_norms.topk(kept).indices] = True
        return keep, ones
    pi = inclusion(sq_norms.double().sqrt(), kept)
    u = (prf_key(*key, _BWD_STREAM) + 0.5) / 2.0 ** 32
    keep = systematic(pi, u)
    factor = torch.where(keep, 1.0 / pi.clamp_min(math.ulp(1.0)), 1.0).to(torch.float32)
    return keep, factor
