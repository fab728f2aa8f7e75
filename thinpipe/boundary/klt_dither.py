"""``klt-dither``: ``klt``'s transform with an unbiased, entropy-coded forward (issue 52, items 2-4; not in either
paper; experiments/frontier/README.md).

Why: issue 52's diagnosis replaced ``KLTw 3-1b-1b T70 q8``'s forward by zero-mean noise of the codec's own error
power and took 1.07 of its 2.78 points of gap away: the fixed-width Lloyd-Max codes' bias (their shrinkage, the
directions they delete) costs training more than fresh noise does. So this kind keeps the KLT basis and spends the
bits differently:

- **unbiased**: each component z_i (the KLT coefficient over its standard deviation) is quantised on a uniform grid
  of step delta_i with subtractive dither, z_hat = delta (round(z / delta + u) - u), u ~ U(-1/2, 1/2) drawn by both
  ends from the boundary's PRF (seed, boundary, step, microbatch, replica, token class), never sent: the error is
  uniform, zero-mean and independent of the signal, and no component is deleted (``boundary.klt-dither.dither =
  false``: plain uniform steps, deterministic);
- **entropy coded**: the indices cross as an ANS stream under a quantised Gaussian model both ends compute from the
  steps (``entropy_code.py``); bits follow the entropy, not a fixed width, and no token needs a scale (a heavy token
  just has larger indices);
- **steps by reverse water-filling on the coder's rate**: per token class (scored tokens ``bits``, the others
  ``context_bits``, bits per dim on average), the steps minimise sum_i lambda_i D(delta_i) under sum_i H(delta_i) =
  the budget (a Lagrangian on a grid of 160 steps; D = delta^2 / 12 with dither, the exact Gaussian rounding error
  without; H the model's entropy), chosen by the owner at the start and sent as one byte per component and class.

The start (the residual start's batches, as ``klt``'s): the C intact channels, mean, basis (int8 columns by
default), the components' standard deviations and the two step tables; metered on ``pp_params``. Every component
with variance is kept (m = d - C).

Bytes per microbatch: 2 C N for the intact channels, then each class's coded stream, whole 32-bit words plus one CRC
word: data-dependent, counted exactly by the meter (``Payload.nbytes``). The receiver bounds a stream at 24 bits an
index (``entropy_code.max_coded_bytes``) before it allocates; a stream that does not decode to its CRC is refused.
``expected_bytes`` is the coder's model estimate (a unit Gaussian per component: real activations' heavier tails
cost more), ``max_bytes`` the bound. Backward: ``klt``'s (``outlier``'s Lloyd-Max codes, ``bwd_tokens`` of the
tokens). The dither changes every step, so GSPO's two forwards of a sequence would differ: refused with GSPO.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from thinpipe.boundary.base import Payload, implements
from thinpipe.boundary.entropy_code import (
    decode,
    dequantise,
    dither,
    encode,
    entropy_bits,
    index_spread,
    max_coded_bytes,
    quantise,
)
from thinpipe.boundary.klt import KltBoundary
from thinpipe.boundary.outlier import OutlierBoundary
from thinpipe.boundary.transform_code import BASIS_DTYPE, MAX_BITS, int8_columns
from thinpipe.comm.header import Expect, PayloadError
from thinpipe.config.boundary_kinds import KltDitherKind

STEPS = 160  # the grid of steps (in standard deviations): 0.01 .. 20, log-spaced; a table entry is an index into it
CLASSES = ("loss", "context")


@cache
def step_grid() -> tuple[torch.Tensor, dict[bool, tuple[np.ndarray, np.ndarray]]]:
    """(the steps, float32; per dither on / off: (D, H) of a unit Gaussian at each step, float64)."""
    grid = np.exp(np.linspace(math.log(0.01), math.log(20.0), STEPS))
    z = np.linspace(-12, 12, 48_001)
    pdf = np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    dz = z[1] - z[0]
    plain_d = np.array([float(((z - d * np.round(z / d)) ** 2 * pdf).sum() * dz) for d in grid])
    tables = {True: (grid ** 2 / 12, np.array([entropy_bits(d, True) for d in grid])),
              False: (plain_d, np.array([entropy_bits(d, False) for d in grid]))}
    return torch.tensor(grid, dtype=torch.float32), tables


def allocate_steps(variances: torch.Tensor, mean_bits: float, dithered: bool) -> torch.Tensor:
    """Per component, the index of its step on ``step_grid``: minimise sum_i lambda_i D(delta_i) with sum_i
    H(delta_i) = ``mean_bits`` x m (the Lagrangian's slope by bisection; the cheapest steps at or under the budget)."""
    _, tables = step_grid()
    dist, rate = tables[dithered]
    lam = variances.double().numpy()[:, None]

    def pick(theta: float) -> np.ndarray:
        return np.argmin(lam * dist[None, :] + theta * rate[None, :], axis=1)

    budget = mean_bits * lam.shape[0]
    lo, hi = 1e-12, 1e6  # slope: bits are cheap (fine steps) .. dear (coarse)
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if rate[pick(mid)].sum() > budget:
            lo = mid
        else:
            hi = mid
    return torch.from_numpy(pick(hi).astype(np.uint8))


@implements(KltDitherKind)
class KltDitherBoundary(KltBoundary):
    RESIZED = (*KltBoundary.RESIZED, "steps_loss", "steps_context")
    steps_loss: torch.Tensor
    steps_context: torch.Tensor

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        own = cfg.settings()
        return cls(index, hidden_size, own.bits, own.context_bits, cfg.bits()[1], cfg.quant_group, wire_dtype,
                   channels=own.channels, bwd_tokens=own.bwd_tokens, bwd_select=own.bwd_select,
                   basis_dtype=own.basis_dtype, dithered=own.dither, seed=seed)

    def __init__(self, index: int, hidden_size: int, loss_bits: float, context_bits: float, bwd_bits: int,
                 group: int, wire_dtype: torch.dtype | None = None, *, channels: int = 4, bwd_tokens: float = 0.5,
                 bwd_select: str = "top", basis_dtype: str = "int8", dithered: bool = True, seed: int = 0):
        # klt's forward state, without its fixed-width tables (whose Lloyd-Max design up to 8 bits this kind never uses)
        OutlierBoundary.__init__(self, index, hidden_size, channels, 1, bwd_bits, group, wire_dtype,
                                 intact_dtype=BASIS_DTYPE, grid="lloyd-max", bwd_scale_group=-1, bwd_tokens=bwd_tokens,
                                 bwd_select=bwd_select, seed=seed)
        if not 0 < loss_bits <= MAX_BITS or not 0 < context_bits <= MAX_BITS:
            raise ValueError(f"boundary.klt-dither.bits and context_bits must be in (0, {MAX_BITS}], got {loss_bits} "
                             f"and {context_bits}")
        if basis_dtype not in ("bfloat16", "int8"):
            raise ValueError(f"boundary.klt-dither.basis_dtype must be bfloat16 or int8, got {basis_dtype!r}")
        self.loss_bits, self.context_bits, self.refresh_every, self.per_width = loss_bits, context_bits, 0, False
        self.basis_int8, self.noise_equivalent, self.seed = basis_dtype == "int8", False, seed
        self.dithered = dithered
        self.forward_state = True  # a fresh dither every step: GSPO's two forwards of a sequence would differ
        d = hidden_size
        self.register_buffer("mean", torch.zeros(d, dtype=BASIS_DTYPE))  # until the residual start fits them
        self.register_buffer("basis", torch.eye(d, dtype=BASIS_DTYPE))
        self.register_buffer("std", torch.ones(d, dtype=BASIS_DTYPE))
        self._step, self._seen = -1, set()
        flat = torch.ones(hidden_size)
        self.register_buffer("steps_loss", allocate_steps(flat, loss_bits, dithered))
        self.register_buffer("steps_context", allocate_steps(flat, context_bits, dithered))

    # the start -------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_residuals(self, residuals: torch.Tensor) -> Payload:
        channels = OutlierBoundary.init_from_residuals(self, residuals).tensors["channels"]
        x = residuals.double().clone()
        x[:, channels] = 0.0  # sent intact: the basis codes the rest
        mean = x.mean(0)
        cov = (x - mean).T @ (x - mean) / max(x.shape[0] - 1, 1)
        keep = max(self.hidden_size - channels.numel(), 1)  # every component with variance: none deleted
        lam, vec = torch.linalg.eigh(cov)  # ascending: the KLT, descending (as klt's fit_moments, every component)
        lam, vec = lam.flip(0)[:keep].clamp_min(0.0), vec.flip(1)[:, :keep]
        mean, basis = mean.to(BASIS_DTYPE), vec.to(BASIS_DTYPE).contiguous()
        # a floor of 1/1000 of the top component's: a direction nearly empty at the start may fill as training moves,
        # and its coefficients over a vanishing deviation would be indices the coder clamps
        std = lam.sqrt().clamp_min(max(float(lam[0].sqrt()) * 1e-3, 1e-12)).to(BASIS_DTYPE)
        var = std.float().pow(2)
        steps = {f"steps_{c}": allocate_steps(var, b, self.dithered)
                 for c, b in zip(CLASSES, (self.loss_bits, self.context_bits))}
        basis_t = {"basis": basis} if not self.basis_int8 else int8_columns(basis.float())
        return Payload({"channels": channels, "mean": mean, **basis_t, "std": std, **steps})

    @torch.no_grad()
    def load_init(self, payload: Payload) -> None:
        p, d = payload.tensors, self.hidden_size
        m = p["basis"].shape[-1] if "basis" in p and p["basis"].dim() == 2 else -1
        int8 = ("basis_scale",) if self.basis_int8 else ()
        ok = (set(p) == {"channels", "mean", "basis", "std", "steps_loss", "steps_context", *int8}
              and p["basis"].shape == (d, m) and 1 <= m <= d and p["mean"].shape == (d,)
              and all(p[k].shape == (m,) for k in ("std", "steps_loss", "steps_context", *int8))
              and all(p[k].dtype == BASIS_DTYPE for k in ("mean", "std", *int8))
              and p["basis"].dtype == (torch.int8 if int8 else BASIS_DTYPE)
              and all(p[k].dtype == torch.uint8 and int(p[k].max()) < STEPS for k in ("steps_loss", "steps_context"))
              and bool(torch.isfinite(p["basis"].float()).all() and (p["std"].float() > 0).all()))
        if not ok:
            raise PayloadError(f"boundary {self.index}: the klt-dither start does not fit this boundary (hidden size "
                               f"{d})")
        OutlierBoundary.load_init(self, Payload({"channels": p["channels"]}))
        basis = p["basis"] if not int8 else p["basis"].float() * p["basis_scale"].float()
        dev = self.mean.device
        self.mean, self.basis, self.std = p["mean"].to(dev).clone(), basis.to(dev).clone(), p["std"].to(dev).clone()
        self.steps_loss, self.steps_context = p["steps_loss"].to(dev).clone(), p["steps_context"].to(dev).clone()

    # the forward -----------------------------------------------------------------------------------
    def _steps(self, c: str) -> torch.Tensor:
        return step_grid()[0][getattr(self, f"steps_{c}").long().cpu()]

    def _dither(self, c: str, rows: int, ctx) -> torch.Tensor | None:
        if not self.dithered:
            return None
        key = hash((self.seed, self.index, ctx.step, ctx.microbatch, ctx.replica, CLASSES.index(c)))
        return dither((rows, self.basis.shape[1]), key)

    def encode(self, x, ctx):
        flat = x.detach().float().reshape(-1, self.hidden_size).clone()
        out = {"intact": flat[:, self.channels].to(BASIS_DTYPE)}
        flat[:, self.channels] = 0.0
        z = (((flat - self.mean.float()) @ self.basis.float()) / self.std.float()).cpu()
        for c, rows in self._classes(ctx).items():
            step = self._steps(c)
            q = quantise(z[rows.cpu()], step, self._dither(c, rows.numel(), ctx))
            out[f"{c}_codes"] = encode(q, index_spread(step, self.dithered)).to(x.device)
        return x, Payload(out)

    def decode(self, payload, ctx):
        self._check(payload.tensors, ctx)
        p, dev = payload.tensors, self.basis.device
        z = torch.zeros(ctx.input_ids.numel(), self.basis.shape[1])
        for c, rows in self._classes(ctx).items():
            step = self._steps(c)
            q = decode(p[f"{c}_codes"].cpu(), index_spread(step, self.dithered), (rows.numel(), step.numel()),
                       f"boundary {self.index}")
            z[rows.cpu()] = dequantise(q, step, self._dither(c, rows.numel(), ctx))
        x = self.mean.float() + (z.to(dev) * self.std.float()) @ self.basis.float().T
        x[:, self.channels] = p["intact"].float()
        return x.reshape(*ctx.input_ids.shape, self.hidden_size)

    # what crosses -----------------------------------------------------------------------------------
    def _check(self, p: dict, ctx) -> None:
        n = ctx.tokens
        counts = {c: int(r.numel()) for c, r in self._classes(ctx).items()}
        ok = (set(p) == {"intact", "loss_codes", "context_codes"}
              and tuple(p["intact"].shape) == (n, self.channels.numel()) and p["intact"].dtype == BASIS_DTYPE
              and all(p[f"{c}_codes"].dtype == torch.uint8 and p[f"{c}_codes"].dim() == 1
                      and p[f"{c}_codes"].numel() <= max_coded_bytes(counts[c] * self.basis.shape[1])
                      for c in CLASSES))
        if not ok:
            raise PayloadError(f"boundary {self.index}: the klt-dither payload does not match this microbatch's tokens")

    def payload_expect(self, direction, tokens, ctx=None):
        """Backward: ``klt``'s. Forward: at most the intact channels and each class's stream at 24 bits an index
        (with ``ctx``, the microbatch's split; without it, the larger split)."""
        if direction == "bwd":
            return super().payload_expect(direction, tokens, ctx)
        return Expect(max_bytes=self.max_bytes(tokens, 4)[0], dtypes=frozenset({BASIS_DTYPE, torch.uint8}))

    def _model_bits(self, c: str) -> float:
        """The coder's model of a token of class ``c``: its steps' entropies on a unit Gaussian, in bits."""
        _, tables = step_grid()
        return float(tables[self.dithered][1][getattr(self, f"steps_{c}").long().cpu().numpy()].sum())

    def _fwd_bytes(self, loss: int, context: int) -> int:
        """The model's estimate: the intact channels, each class's entropy, whole words and a CRC word a stream."""
        streams = sum(4 * (math.ceil(n * self._model_bits(c) / 32) + 3) for c, n in zip(CLASSES, (loss, context)))
        return 2 * self.channels.numel() * (loss + context) + streams

    def max_bytes(self, tokens, element_size):
        m = self.basis.shape[1]
        bound = 2 * self.channels.numel() * tokens + max_coded_bytes(tokens * m) + max_coded_bytes(0)
        return bound, self._bwd_bytes(tokens, element_size)

    def planned_bytes(self, tokens, element_size):
        """The planner's estimate: every token scored, the coder's model of ``bits`` per dim, the intact channels."""
        per_token = self.channels.numel() * 2 + self.loss_bits * self.hidden_size / 8
        return tokens * per_token, self.expected_bytes(tokens, element_size)[1]
