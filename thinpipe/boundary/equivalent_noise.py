"""The noise-equivalent diagnosis of a transform codec (issue 52; ``boundary.klt.noise_equivalent``): its error
without its bias.

Given the activations x, the codec's reconstruction x_hat and its basis U (d x m), the noise has the codec's own
error power (x - x_hat) per token class: in each direction of U its mean square, and in the rest of the coded space
(the directions the basis drops) its mean energy spread evenly; the intact channels get none. It is zero-mean
Gaussian, drawn fresh from a generator of its own for every key (step, microbatch, replica), independent of x:
unbiased, unlike Lloyd-Max codes, which shrink. experiments/frontier/README.md ("Issue 52") has what it showed.
"""

from __future__ import annotations

import torch


def equivalent_noise(x: torch.Tensor, x_hat: torch.Tensor, basis: torch.Tensor, channels: torch.Tensor,
                     classes: dict[str, torch.Tensor], key: int) -> torch.Tensor:
    """x (N, d) plus the noise (module docstring); ``classes``: the token rows of each class; ``key``: the PRF key."""
    err = x - x_hat
    err[:, channels] = 0.0
    gen = torch.Generator().manual_seed(key & (2 ** 62 - 1))
    rest = x.shape[1] - basis.shape[1] - channels.numel()  # dimensions outside the basis, in the coded space
    noisy = x.clone()
    for rows in classes.values():
        if not rows.numel():
            continue
        e_u = err[rows] @ basis
        power = e_u.pow(2).mean(0)  # per direction of the basis
        noise = (torch.randn(e_u.shape, generator=gen).to(basis.device) * power.sqrt()) @ basis.T
        if rest > 0:
            r = err[rows] - e_u @ basis.T
            g = torch.randn(noise.shape, generator=gen).to(basis.device)
            g[:, channels] = 0.0
            g = g - (g @ basis) @ basis.T
            noise += g * (r.pow(2).sum(1).mean() / rest).sqrt()
        noisy[rows] += noise
    return noisy
