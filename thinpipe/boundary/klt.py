"""``klt``: transform coding fitted to the model (KLT / PCA basis, reverse water-filling), with bits
where the loss is (not in either paper; issue 36, measured in experiments/frontier/README.md).

Why: a Hadamard rotation (``outlier``) makes every coordinate of an activation look alike; it does not
decorrelate them. The activations' Karhunen-Loeve transform (the eigenvectors of their covariance)
does, and its coding gain on SmolLM2's boundaries (arithmetic over geometric mean of the eigenvalues)
is 5.5-6.4 dB: about one bit per dimension that a rotation leaves unused. Transform coding spends
those bits by reverse water-filling (Cover & Thomas §10.3.3): a component of variance lambda_i gets
b_i bits so that every coded component ends with about the same distortion, none where lambda_i is
below it. Here b_i are whole bits on the Lloyd-Max grid of N(0, 1) (``lloyd_max.py``), allocated
greedily by each extra bit's drop in distortion, lambda_i (D(b) - D(b+1)), which for the convex
D(b) of Lloyd-Max quantisers is the optimal integer allocation (Fox 1966, "Discrete optimization via
marginal analysis").

Bits where the loss is: every stage already knows which tokens carry loss (labels never cross a
boundary: ``rank/context.py``), so the tokens whose output is scored get ``klt_bits`` bits per
dimension on average and the others (prompt, padding) ``klt_context_bits``, from two allocation
tables on one basis; no map crosses the wire. A token whose output is scored is position t with
``labels[t + 1] != -100`` (the next-token loss, ``models/loss.py``).

The start: the sender calibrates the C = ``klt_channels`` massive-activation channels (``outlier``'s
calibration; they cross intact in bf16) and fits the basis on the rest of the residual start's
batches (the raw activations at this boundary, ``Boundary.init_from_residuals``; the data-driven
start MAPL's PCA start uses): their mean mu and covariance's eigenpairs (U, lambda), descending. Only
the m components that get a bit in either table are kept. The start payload (the channels: C int64,
mu: d bf16, U_m: d x m bf16, or with ``klt_basis_dtype = int8`` d x m int8 codes and one bf16 step
per column, sqrt(lambda_m): m bf16, the two tables: 2 x m uint8) crosses once from
the owner to every other copy and is metered on ``pp_params`` (``engine``: the residual start). Both
ends code with the bf16 values they hold, so they agree bitwise.

Forward, per token: z = ((x - mu) U_m) / sqrt(lambda_m) (the intact channels zeroed in x), one bf16
RMS per bit width over the components the token's table codes at that width (``klt_scale = width``;
``token``: one over all of them), and each coded component's Lloyd-Max code of z_i / its width's
scale; the receiver sets x_hat = mu + U_m (scale level(code) sqrt(lambda)) (uncoded components: 0,
i.e. the mean) and writes the intact channels back. Why a scale per width: a few tokens (SmolLM2's
early template tokens) sit far out along the top components; one scale per token then clips their
top coefficients and rounds their others to 0, a 100x larger error on the middle boundary. Codes of
equal width are packed together (``quant.pack_bits``), byte-aligned, and a class's widths travel in
one tensor, ascending: 5 tensors per payload (intact channels, scales and codes of each class).

Backward: the activation gradient on ``outlier``'s Lloyd-Max grid (Hadamard tiles of ``quant_group``,
one bf16 RMS per token, ``bwd_bits`` bits), with ``klt_bwd_tokens`` = f < 1 sending only the
ceil(f N) tokens of largest gradient norm and a bitmap of N bits naming them (its bytes counted).

The refresh (``klt_refresh_every`` = N > 0): every N steps both ends refit the forward basis and tables from
the decoded activations they both hold, and fit the gradient's own basis from the decoded gradients (no byte
crosses; ``_refresh``; float64 moments saved with the checkpoint; decoded data keeps the codes' bias).

The noise-equivalent diagnosis (``klt_noise_equivalent``, issue 52): ``equivalent_noise.py``, dense fp32.

Bytes per microbatch of N tokens, L of them scored (forward), n_k(t) the components of width k, w(t) the widths of
table t: 2 C N + sum over t of (2 w(t) n_t + sum_k ceil(n_t n_k(t) k / 8)); backward ``outlier``'s (``expected_bytes``).
"""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Payload, implements
from thinpipe.boundary.equivalent_noise import equivalent_noise
from thinpipe.boundary.klt_refresh import KltRefresh
from thinpipe.boundary.lloyd_max import SCALE_DTYPE
from thinpipe.boundary.outlier import OutlierBoundary
from thinpipe.boundary.quant import pack_bits, packed_bytes, unpack_bits
from thinpipe.boundary.transform_code import (
    BASIS_DTYPE,
    MAX_BITS,
    allocate_bits,
    code,
    codes_bytes,
    dtype_bytes,
    fit_moments,
    int8_columns,
    loss_tokens,
    spec_bytes,
    uncode,
    widths,
)
from thinpipe.comm.header import Expect, PayloadError
from thinpipe.config.boundary_kinds import KltKind

CLASSES = ("loss", "context")
SCALES = ("width", "token")


@implements(KltKind)
class KltBoundary(KltRefresh, OutlierBoundary):
    RESIZED: tuple[str, ...] = ("basis", "std", "bits_loss", "bits_context", "gbasis", "gstd", "gbits")
    # buffers the typed methods use (registered in __init__; the refresh's with refresh_every > 0), for the checker
    mean: torch.Tensor
    grad_klt: torch.Tensor
    fwd_sum: torch.Tensor
    fwd_sq: torch.Tensor
    fwd_n: torch.Tensor
    bwd_sq: torch.Tensor
    bwd_n: torch.Tensor

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        own = cfg.settings()
        return cls(index, hidden_size, own.bits, own.context_bits, cfg.bits()[1], cfg.quant_group, wire_dtype,
                   channels=own.channels, bwd_tokens=own.bwd_tokens, bwd_select=own.bwd_select,
                   refresh_every=own.refresh_every,
                   scale=own.scale, basis_dtype=own.basis_dtype, noise_equivalent=own.noise_equivalent, seed=seed)

    def __init__(self, index: int, hidden_size: int, loss_bits: float, context_bits: float, bwd_bits: int,
                 group: int, wire_dtype: torch.dtype | None = None, *, channels: int = 4, bwd_tokens: float = 1.0,
                 bwd_select: str = "top", refresh_every: int = 0, scale: str = "width", basis_dtype: str = "bfloat16",
                 noise_equivalent: bool = False, seed: int = 0):
        super().__init__(index, hidden_size, channels, 1, bwd_bits, group, wire_dtype, intact_dtype=BASIS_DTYPE,
                         grid="lloyd-max", bwd_scale_group=-1, bwd_tokens=bwd_tokens, bwd_select=bwd_select, seed=seed)
        if not 0 < loss_bits <= MAX_BITS or not 0 < context_bits <= MAX_BITS:
            raise ValueError(f"boundary.klt.bits and boundary.klt.context_bits must be in (0, {MAX_BITS}], got "
                             f"{loss_bits} and {context_bits}")
        if round(min(loss_bits, context_bits) * hidden_size) < 1:
            raise ValueError(f"boundary.klt.context_bits = {context_bits} leaves no bit for a token of {hidden_size} "
                             "dims")
        if scale not in SCALES:
            raise ValueError(f"boundary.klt.scale must be one of {SCALES}, got {scale!r}")
        self.loss_bits, self.context_bits, self.refresh_every = loss_bits, context_bits, refresh_every
        self.per_width = scale == "width"
        if basis_dtype not in ("bfloat16", "int8"):
            raise ValueError(f"boundary.klt.basis_dtype must be bfloat16 or int8, got {basis_dtype!r}")
        self.basis_int8 = basis_dtype == "int8"
        # a refresh changes the codes from the decoded data of the steps before it: RL's two forwards of one
        # sequence must code it alike, so a refreshing boundary is refused with GSPO (objective/gspo.py)
        self.forward_state = refresh_every > 0
        # the diagnosis (``boundary.klt.noise_equivalent``): fresh noise per microbatch makes RL's two forwards differ
        self.noise_equivalent, self.seed = noise_equivalent, seed
        self.forward_state |= noise_equivalent
        d = hidden_size
        # Until the residual start fits them: the identity basis, unit variances, an even allocation
        # (a start, never a result: a run always fits the basis before its first step).
        self.register_buffer("mean", torch.zeros(d, dtype=BASIS_DTYPE))
        self.register_buffer("basis", torch.eye(d, dtype=BASIS_DTYPE))
        self.register_buffer("std", torch.ones(d, dtype=BASIS_DTYPE))
        flat = torch.ones(d)
        self.register_buffer("bits_loss", allocate_bits(flat, loss_bits).to(torch.uint8))
        self.register_buffer("bits_context", allocate_bits(flat, context_bits).to(torch.uint8))
        if refresh_every:
            # the gradient's own basis, fitted at the first refresh (until then: outlier's Hadamard tiles)
            self.register_buffer("grad_klt", torch.zeros((), dtype=torch.bool))
            self.register_buffer("gbasis", torch.eye(d, dtype=BASIS_DTYPE))
            self.register_buffer("gstd", torch.ones(d, dtype=BASIS_DTYPE))
            self.register_buffer("gbits", allocate_bits(flat, bwd_bits).to(torch.uint8))
            # moments of the decoded data since the last refresh, which both ends hold (float64 sums)
            self.register_buffer("fwd_sum", torch.zeros(d, dtype=torch.float64))
            self.register_buffer("fwd_sq", torch.zeros(d, d, dtype=torch.float64))
            self.register_buffer("fwd_n", torch.zeros((), dtype=torch.float64))
            self.register_buffer("bwd_sq", torch.zeros(d, d, dtype=torch.float64))
            self.register_buffer("bwd_n", torch.zeros((), dtype=torch.float64))
        self._step = -1
        self._seen: set[tuple[int, str]] = set()  # (microbatch, direction) added to the moments this step

    # the start: the basis and tables, fitted by the owner, loaded by every copy ---------------------
    @property
    def wants_residual_init(self) -> bool:
        return True

    @torch.no_grad()
    def init_from_residuals(self, residuals: torch.Tensor) -> Payload:
        channels = super().init_from_residuals(residuals).tensors["channels"]
        x = residuals.double().clone()
        x[:, channels] = 0.0  # sent intact: the basis codes the rest
        mean = x.mean(0)
        cov = (x - mean).T @ (x - mean) / max(x.shape[0] - 1, 1)
        mean, basis, std, (loss, context) = fit_moments(mean, cov, (self.loss_bits, self.context_bits))
        basis = {"basis": basis} if not self.basis_int8 else int8_columns(basis.float())
        return Payload({"channels": channels, "mean": mean, **basis, "std": std, "bits_loss": loss,
                        "bits_context": context})

    @torch.no_grad()
    def load_init(self, payload: Payload) -> None:
        p, d = payload.tensors, self.hidden_size
        m = p["basis"].shape[-1] if "basis" in p and p["basis"].dim() == 2 else -1
        int8 = ("basis_scale",) if self.basis_int8 else ()
        ok = (set(p) == {"channels", "mean", "basis", "std", "bits_loss", "bits_context", *int8}
              and p["basis"].shape == (d, m) and 1 <= m <= d and p["mean"].shape == (d,)
              and all(p[k].shape == (m,) for k in ("std", "bits_loss", "bits_context", *int8))
              and all(p[k].dtype == BASIS_DTYPE for k in ("mean", "std", *int8))
              and p["basis"].dtype == (torch.int8 if int8 else BASIS_DTYPE)
              and all(p[k].dtype == torch.uint8 and int(p[k].max()) <= MAX_BITS for k in ("bits_loss", "bits_context"))
              and bool(torch.isfinite(p["basis"].float()).all() and (p["std"].float() > 0).all()))
        if not ok:
            raise PayloadError(f"boundary {self.index}: the KLT start does not fit this boundary (hidden size {d})")
        super().load_init(Payload({"channels": p["channels"]}))
        basis = p["basis"] if not int8 else p["basis"].float() * p["basis_scale"].float()  # fp32, exactly alike
        self._set_forward(p["mean"], basis, p["std"], p["bits_loss"], p["bits_context"])

    def _set_forward(self, mean, basis, std, loss, context) -> None:
        dev = self.mean.device
        self.mean, self.basis, self.std = mean.to(dev).clone(), basis.to(dev).clone(), std.to(dev).clone()
        self.bits_loss, self.bits_context = loss.to(dev).clone(), context.to(dev).clone()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a fitted basis keeps m <= d components: size the buffers to the saved ones before loading
        for name in self.RESIZED:
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and hasattr(self, name):
                setattr(self, name, torch.empty_like(saved, device=self.mean.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # the forward -------------------------------------------------------------------------------
    def _classes(self, ctx) -> dict[str, torch.Tensor]:
        scored = loss_tokens(ctx.labels).reshape(-1)
        return {"loss": scored.nonzero().flatten(), "context": (~scored).nonzero().flatten()}

    def encode(self, x, ctx):
        self._at_step(ctx.step)
        flat = x.detach().float().reshape(-1, self.hidden_size).clone()
        out = {"intact": flat[:, self.channels].to(BASIS_DTYPE)}
        flat[:, self.channels] = 0.0
        z = ((flat - self.mean.float()) @ self.basis.float()) / self.std.float()
        for c, rows in self._classes(ctx).items():
            out[f"{c}_scale"], out[f"{c}_codes"] = code(z[rows], getattr(self, f"bits_{c}"), self.per_width)
        if self.noise_equivalent:  # the diagnosis: the codec's error power without its bias (equivalent_noise.py)
            key = hash((self.seed, self.index, ctx.step, ctx.microbatch, ctx.replica))
            return x, Payload({"x": equivalent_noise(x.detach().float().reshape(-1, self.hidden_size),
                                                     self._decode(out, ctx), self.basis.float(), self.channels,
                                                     self._classes(ctx), key)})
        if self.refresh_every and (ctx.microbatch, "fwd") not in self._seen:  # the sender's copy of x_hat
            self._observe_forward(self._decode(out, ctx), ctx)
        return x, Payload(out)

    def _observe_forward(self, x_hat: torch.Tensor, ctx) -> None:
        """The loss tokens' decoded activations (the best-coded ones), intact channels out as at the start."""
        rows = x_hat.reshape(-1, self.hidden_size)[self._classes(ctx)["loss"]].clone()
        rows[:, self.channels] = 0.0
        self._observe(ctx, "fwd", rows)

    def decode(self, payload, ctx):
        self._at_step(ctx.step)
        self._check(payload.tensors, ctx)
        if self.noise_equivalent:
            return payload.tensors["x"].reshape(*ctx.input_ids.shape, self.hidden_size)
        x = self._decode(payload.tensors, ctx)
        if self.refresh_every and (ctx.microbatch, "fwd") not in self._seen:
            self._observe_forward(x, ctx)
        return x.reshape(*ctx.input_ids.shape, self.hidden_size)

    def _decode(self, p: dict, ctx) -> torch.Tensor:
        z = torch.zeros(ctx.input_ids.numel(), self.basis.shape[1], device=self.basis.device)
        for c, rows in self._classes(ctx).items():
            z[rows] = uncode(p[f"{c}_scale"], p[f"{c}_codes"], getattr(self, f"bits_{c}"))
        x = self.mean.float() + (z * self.std.float()) @ self.basis.float().T
        x[:, self.channels] = p["intact"].float()
        return x

    # the backward: outlier's Hadamard tiles until the gradient's own basis is fitted ---------------
    def _grad_klt(self) -> bool:
        return bool(self.refresh_every and self.grad_klt)

    def encode_grad(self, g, ctx):
        self._at_step(ctx.step)
        if not self._grad_klt():
            payload = super().encode_grad(g, ctx)
        else:
            flat = g.detach().float().reshape(-1, self.hidden_size)
            keep, factor = self._select(flat, ctx)
            z = ((flat[keep] * factor[keep, None]) @ self.gbasis.float()) / self.gstd.float()
            scale, codes = code(z, self.gbits, self.per_width)
            payload = Payload({**({"tokens": pack_bits(keep, 1)} if self.bwd_tokens < 1 else {}),
                               "scale": scale, "codes": codes})
        if self.refresh_every and (ctx.microbatch, "bwd") not in self._seen:  # the receiver's copy of g_hat
            self._observe_backward(self.decode_grad(payload, ctx), ctx)
        return payload

    def _observe_backward(self, g_hat: torch.Tensor, ctx) -> None:
        flat = g_hat.reshape(-1, self.hidden_size)
        self._observe(ctx, "bwd", flat[flat.abs().sum(1) > 0])  # the tokens sent

    def decode_grad(self, payload, ctx):
        self._at_step(ctx.step)
        if not self._grad_klt():
            g = super().decode_grad(payload, ctx)
        else:
            p, n = payload.tensors, ctx.input_ids.numel()
            keep = unpack_bits(p["tokens"], 1, n).bool() if self.bwd_tokens < 1 else \
                torch.ones(n, dtype=torch.bool, device=p["codes"].device)
            if int(keep.sum()) != self._kept(n):
                raise PayloadError(f"boundary {self.index}: the gradient's token bitmap names {int(keep.sum())} "
                                   f"tokens, not {self._kept(n)}")
            g = torch.zeros(n, self.hidden_size, device=p["codes"].device)
            g[keep] = (uncode(p["scale"], p["codes"], self.gbits) * self.gstd.float()) @ self.gbasis.float().T
            g = g.reshape(*ctx.input_ids.shape, self.hidden_size)
        if self.refresh_every and (ctx.microbatch, "bwd") not in self._seen:  # the sender's copy of g_hat
            self._observe_backward(g, ctx)
        return g

    # what crosses ------------------------------------------------------------------------------
    def _fwd_spec(self, counts: dict[str, int]) -> dict:
        spec: dict[str, tuple] = {"intact": ((sum(counts.values()), self.channels.numel()), BASIS_DTYPE)}
        for c in CLASSES:
            spec[f"{c}_scale"] = ((counts[c], self._scales(getattr(self, f"bits_{c}"))), SCALE_DTYPE)
            spec[f"{c}_codes"] = ((codes_bytes(counts[c], getattr(self, f"bits_{c}")),), torch.uint8)
        return spec

    def _bwd_spec(self, tokens: int) -> dict:
        k = self._kept(tokens)
        spec = {"tokens": ((packed_bytes(tokens, 1),), torch.uint8)} if self.bwd_tokens < 1 else {}
        return {**spec, "scale": ((k, self._scales(self.gbits)), SCALE_DTYPE),
                "codes": ((codes_bytes(k, self.gbits),), torch.uint8)}

    def _scales(self, bits: torch.Tensor) -> int:
        """Scales per token of a table: one per width it codes, or one."""
        return len(widths(bits)) if self.per_width else 1

    def _check(self, p: dict, ctx) -> None:
        expect = self.payload_expect("fwd", ctx.tokens, ctx)
        got = {k: (tuple(t.shape), t.dtype) for k, t in p.items()}
        if got != expect.spec:
            raise PayloadError(f"boundary {self.index}: the KLT payload does not match this microbatch's tokens")

    def payload_expect(self, direction, tokens, ctx=None):
        """Backward: the exact tensors (``outlier``'s until the gradient's basis is fitted). Forward: the
        exact tensors for this microbatch's loss / context split when ``ctx`` is given, else the larger
        of the all-loss and all-context payloads (an upper bound: bytes are linear in the split). A
        receiver asks before it decodes: a refresh due at this step happens here first, as the sender's
        happened before it encoded."""
        if ctx is not None:
            self._at_step(ctx.step)
        if direction == "bwd":
            return Expect.exactly(self._bwd_spec(tokens)) if self._grad_klt() else \
                super().payload_expect(direction, tokens)
        if self.noise_equivalent:
            return Expect.exactly(self._noisy_spec(tokens))
        if ctx is not None:
            counts = {c: int(r.numel()) for c, r in self._classes(ctx).items()}
            return Expect.exactly(self._fwd_spec(counts))
        bound = max(self._fwd_bytes(tokens, 0), self._fwd_bytes(0, tokens))
        return Expect(max_bytes=bound, dtypes=frozenset({SCALE_DTYPE, torch.uint8}))

    def _noisy_spec(self, tokens: int) -> dict:
        return {"x": ((tokens, self.hidden_size), torch.float32)}

    def _fwd_bytes(self, loss: int, context: int) -> int:
        if self.noise_equivalent:  # the diagnosis sends the noisy activations whole
            return spec_bytes(self._noisy_spec(loss + context))
        return spec_bytes(self._fwd_spec({"loss": loss, "context": context}))

    def _bwd_bytes(self, tokens: int, element_size: int) -> int:
        return spec_bytes(self._bwd_spec(tokens)) if self._grad_klt() else \
            super().expected_bytes(tokens, element_size)[1]

    def expected_bytes(self, tokens, element_size, loss_tokens: int | None = None):
        """(forward, backward) bytes of a microbatch of ``tokens`` tokens, ``loss_tokens`` of them scored
        (None: all of them; the forward's bytes depend on the split, the backward's do not)."""
        loss = tokens if loss_tokens is None else loss_tokens
        return self._fwd_bytes(loss, tokens - loss), self._bwd_bytes(tokens, element_size)

    def max_bytes(self, tokens, element_size):
        return max(self._fwd_bytes(tokens, 0), self._fwd_bytes(0, tokens)), self._bwd_bytes(tokens, element_size)

    def planned_bytes(self, tokens, element_size):
        """The planner's bound (``thinpipe plan``): every token scored, ``loss_bits`` per dim on average with one
        scale per token, and the C intact channels; the backward as coded. What it leaves out ``thinpipe probe``
        measures: a batch's prompt tokens cost ``context_bits`` instead, a table of several widths has a scale
        per width (``klt.scale = width``: up to 7 more per token), and the start's basis crosses once per run."""
        if self.noise_equivalent:
            return self._fwd_bytes(tokens, 0), self.expected_bytes(tokens, element_size)[1]
        per_token = self.channels.numel() * dtype_bytes(BASIS_DTYPE) + dtype_bytes(SCALE_DTYPE) + self.loss_bits * \
            self.hidden_size / 8
        return tokens * per_token, self.expected_bytes(tokens, element_size)[1]
