"""``klt``'s refresh (``klt_refresh_every`` = N > 0, issue 36): every N steps both ends of a boundary refit the forward
basis and tables from the decoded activations of the scored tokens since the last refit, and fit the gradient's own
basis (its second moment's eigenvectors, ``bwd_bits`` per dim on average, the same codes and scales) from the decoded
gradients, after which the backward is coded in it. Both ends hold that data (each decodes what it sends), so no
byte crosses; each microbatch's moments are added once per copy (the simulation's one object holding both ends skips
the second), in float64 buffers saved with the checkpoint. Decoded data underestimates the variance of coarsely
coded components (by 1 - D(b)), a bias the refit keeps (experiments/frontier/README.md: the R20 arm)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from thinpipe.boundary.transform_code import fit_moments


class KltRefresh:
    """The refresh's steps, mixed into ``KltBoundary`` (which holds the moments' buffers and ``_set_forward``)."""

    # what the boundary holds (KltBoundary registers the buffers)
    hidden_size: int
    bwd_bits: int
    loss_bits: float
    context_bits: float
    refresh_every: int
    _step: int
    _seen: set[tuple[int, str]]
    mean: torch.Tensor
    grad_klt: torch.Tensor
    gbasis: torch.Tensor
    gstd: torch.Tensor
    gbits: torch.Tensor
    fwd_sum: torch.Tensor
    fwd_sq: torch.Tensor
    fwd_n: torch.Tensor
    bwd_sq: torch.Tensor
    bwd_n: torch.Tensor
    _set_forward: Callable[..., None]

    def _at_step(self, step: int) -> None:
        """The first call of a step: a due refresh (every ``refresh_every`` steps) refits both bases from
        the moments of the steps before it. Both ends (and, in the simulation, the one object holding
        them) reach it on their first call of the step, with the same sums."""
        if step == self._step:
            return
        self._step, self._seen = step, set()
        if self.refresh_every and step > 0 and step % self.refresh_every == 0:
            self._refresh()

    def _observe(self, ctx, direction: str, rows: torch.Tensor) -> bool:
        """Add a microbatch's decoded rows to the moments once (the other end, or the simulation's second
        call, computes the same rows and is skipped). False: already added (nothing to compute)."""
        key = (ctx.microbatch, direction)
        if not self.refresh_every or key in self._seen:
            return False
        self._seen.add(key)
        r = rows.double()
        if direction == "fwd":
            self.fwd_sum += r.sum(0)
            self.fwd_sq += r.T @ r
            self.fwd_n += r.shape[0]
        else:
            self.bwd_sq += r.T @ r
            self.bwd_n += r.shape[0]
        return True

    @torch.no_grad()
    def _refresh(self) -> None:
        if float(self.fwd_n) > 1:
            mean = self.fwd_sum / self.fwd_n
            cov = self.fwd_sq / self.fwd_n - torch.outer(mean, mean)
            mean, basis, std, (loss, context) = fit_moments(mean, cov, (self.loss_bits, self.context_bits))
            self._set_forward(mean, basis, std, loss, context)
        if float(self.bwd_n) > 1:  # the gradient's mean is ~0: its second moment is its covariance
            _, gbasis, gstd, (gbits,) = fit_moments(torch.zeros(self.hidden_size), self.bwd_sq / self.bwd_n,
                                                    (float(self.bwd_bits),))
            dev = self.mean.device
            self.gbasis, self.gstd, self.gbits = gbasis.to(dev), gstd.to(dev), gbits.to(dev)
            self.grad_klt.fill_(True)
        for t in (self.fwd_sum, self.fwd_sq, self.fwd_n, self.bwd_sq, self.bwd_n):
            t.zero_()
