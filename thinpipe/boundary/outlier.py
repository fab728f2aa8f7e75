"""``outlier``: calibrated outlier channels sent intact, the rest Hadamard-rotated and quantised
(not in either paper; measured in experiments/frontier/README.md).

Why: a pretrained model's residual stream has a few massive-activation channels, large for every
token (SmolLM2: ``experiments/anchor_priors/forward_damage.py``). They dominate a token's range, so
a uniform low-bit grid spends its levels on them and rounds the rest to a few values; masking drops
them outright. Here both ends agree once on the C channels with the largest mean |activation|
(calibrated on the residual start's batches, the same data-driven start MAPL's PCA start uses,
``Boundary.init_from_residuals``) and send them intact in the wire dtype; the remaining channels
(the outliers zeroed) are rotated by the orthonormal Hadamard transform in tiles of G =
``quant_group`` dims, which spreads each tile's energy evenly (QuaRot / TAH-Quant), and quantised
per tile at ``fwd_bits`` (``quant.py``: bf16 offset and step). The receiver dequantises, rotates
back (H/sqrt(G) is its own inverse) and writes the intact channels over their positions.

Backward: the activation gradient has no calibrated channels; it is rotated and quantised per
tile at ``bwd_bits`` in the same way.

Two byte savers for the forward: ``outlier_scale_group`` = S dims share one offset and step (S a
multiple of G dividing H; S = H, or -1, is one pair per token: 36 -> 4 B per token at H = 576,
G = 64), and ``outlier_dtype = bfloat16`` sends the intact channels in bf16 whatever the wire (fp32
wire: 64 -> 32 B at C = 16). The backward keeps one pair per tile by default: min/max
1-bit codes need the tile's own range.

Further settings (each measured in experiments/frontier/README.md, "New codecs"):

- ``grid = "lloyd-max"``: the rotated values are close to Gaussian (excess kurtosis ~0 on SmolLM2's
  boundaries, ``experiments/frontier/diagnose.py``), so the Lloyd-Max levels of N(0, 1) scaled by each
  group's RMS (``lloyd_max.py``; one bf16 scale, 2 B per group instead of min/max's 4) replace the
  min/max grid: relative MSE 0.36 instead of 2.7 at 1 bit, 0.12 instead of 0.21 at 2 bits.
- ``bwd_scale_group``: the backward's scale group, as ``scale_group`` is the forward's.
- ``bwd_tokens = f < 1``: token-sparse backward. The receiver sends the gradients of K = ceil(f x N)
  of the microbatch's N tokens, a bitmap of N bits naming them; the others arrive as zeros. Which K:
  ``bwd_select`` (``token_sample.py``): ``top``, the largest by norm (on SmolLM2 the top half hold
  95-99% of the energy), or ``sample``, an unbiased draw (kept with probability ~ norm, sent scaled by
  its inverse in the per-token scale: the same bytes).
- ``compress = "fwd"`` / ``"bwd"``: only that direction is compressed, the other crosses dense in
  the wire dtype (the forward/backward split of a setting's loss).
- ``entropy = true`` (with ``lloyd-max``; issue 52 item 4): codes of 2 bits or more cross entropy coded
  (``entropy_code.py``: constriction's ANS under the Lloyd-Max cells' probabilities of a unit Gaussian,
  which both ends know: no table is sent; a CRC word per payload). Lossless: the same values as the
  fixed-width codes, bitwise; 1.911 / 2.825 / 3.765 bits a code at 2 / 3 / 4 bits (the rotated values
  are Gaussian to two decimals). 1-bit codes' two cells are equally likely: they stay packed.

Bytes per token (forward, backward), with s = 4 (minmax) or 2 (lloyd-max) B per scale group:
C x intact bytes + H x fwd_bits / 8 + (H / S) x s, and, per microbatch of N tokens,
K x (H x bwd_bits / 8 + (H / S_bwd) x s) + N / 8 (the bitmap, only when f < 1); a dense direction
is H x wire bytes (``expected_bytes``; tests check them against the meter). Entropy-coded codes
cost what the coder writes (metered as sent): ``expected_bytes`` is the model's estimate, 4 (ceil(n
x entropy / 32) + 3) B for n codes, and the receiver accepts at most 24 bits a code (``max_bytes``).
"""

from __future__ import annotations

import math

import torch

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.boundary.entropy_code import categorical_bits, decode_categorical, encode_categorical, max_coded_bytes
from thinpipe.boundary.lloyd_max import RMS_SCALE_BYTES, dequantize_rms, gaussian_cell_probabilities, quantize_rms
from thinpipe.boundary.lloyd_max import SCALE_DTYPE as RMS_SCALE_DTYPE
from thinpipe.boundary.quant import (
    SCALE_BYTES,
    SCALE_DTYPE,
    QuantBoundary,
    dequantize,
    pack_bits,
    packed_bytes,
    quantize,
    unpack_bits,
)
from thinpipe.boundary.tahquant import hadamard
from thinpipe.boundary.token_sample import SELECTS, select_tokens
from thinpipe.comm.header import Expect, PayloadError
from thinpipe.config.boundary_kinds import OutlierKind

GRIDS = ("minmax", "lloyd-max")


@implements(OutlierKind)
class OutlierBoundary(QuantBoundary):
    channels: torch.Tensor  # the intact channels' indices (a buffer registered in __init__), typed for the checker

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        own, (fwd, bwd) = cfg.settings(), cfg.bits()
        if own.fwd_bits:
            if len(own.fwd_bits) <= index:
                raise ValueError(f"boundary.outlier.fwd_bits = {own.fwd_bits} names no bits for boundary {index}: "
                                 "give one entry per boundary (mesh.pp - 1)")
            fwd = own.fwd_bits[index]
        return cls(index, hidden_size, own.channels, fwd, bwd, cfg.quant_group, wire_dtype, own.scale_group,
                   None if own.dtype == "wire" else torch.bfloat16, grid=own.grid, bwd_scale_group=own.bwd_scale_group,
                   bwd_tokens=own.bwd_tokens, bwd_select=own.bwd_select, compress=cfg.compress, seed=seed,
                   entropy=own.entropy)

    def __init__(self, index: int, hidden_size: int, channels: int, fwd_bits: int, bwd_bits: int, group: int,
                 wire_dtype: torch.dtype | None = None, scale_group: int = 0, intact_dtype: torch.dtype | None = None,
                 *, grid: str = "minmax", bwd_scale_group: int = 0, bwd_tokens: float = 1.0, bwd_select: str = "top",
                 compress: str = "both", seed: int = 0, entropy: bool = False):
        super().__init__(index, hidden_size, fwd_bits, bwd_bits, group, wire_dtype)
        if self.group & (self.group - 1):
            raise ValueError(f"outlier tiles are Hadamard-rotated: boundary.quant_group must be a power of two, got "
                             f"{self.group}")
        self.scale_group = self._scale_group(scale_group, "outlier.scale_group")
        self.bwd_scale_group = self._scale_group(bwd_scale_group, "outlier.bwd_scale_group")
        if (grid not in GRIDS or not 0 < bwd_tokens <= 1 or compress not in ("both", "fwd", "bwd")
                or bwd_select not in SELECTS):
            raise ValueError(f"outlier: grid {grid!r}, bwd_tokens {bwd_tokens}, bwd_select {bwd_select!r}, compress "
                             f"{compress!r} are not {GRIDS}, in (0, 1], {SELECTS} and both/fwd/bwd")
        self.grid, self.bwd_tokens, self.bwd_select, self.compress = grid, bwd_tokens, bwd_select, compress
        self.seed = seed  # the backward's draw under bwd_select = sample (the PRF's key)
        if entropy and grid != "lloyd-max":
            raise ValueError("boundary.outlier.entropy codes the Lloyd-Max grid's codes: set boundary.outlier.grid = "
                             "lloyd-max")
        self.entropy = entropy
        self.scale_bytes = RMS_SCALE_BYTES if grid == "lloyd-max" else SCALE_BYTES
        self.intact_dtype = intact_dtype  # None: the wire dtype
        if not 0 <= channels < hidden_size:
            raise ValueError(f"boundary.outlier.channels must be in [0, {hidden_size}), got {channels}")
        # Until the residual start calibrates them: the first C channels (a start, never a result).
        self.register_buffer("channels", torch.arange(channels, dtype=torch.int64))

    def _scale_group(self, size: int, name: str) -> int:
        s = self.hidden_size if size == -1 else size or self.group
        if s % self.group or self.hidden_size % s:
            raise ValueError(f"boundary.{name} = {size} must be a multiple of the tile (boundary.quant_group = "
                             f"{self.group}) that divides the hidden size {self.hidden_size}")
        return s

    # the residual start: calibration, agreed by both ends ----------------------------------------
    def residual_offset(self, ids):
        return torch.zeros(())  # the raw activation is what is calibrated on

    @property
    def wants_residual_init(self) -> bool:
        return self.channels.numel() > 0

    @torch.no_grad()
    def init_from_residuals(self, residuals: torch.Tensor) -> Payload:
        """The C channels with the largest mean |activation| over the calibration tokens, ascending."""
        score = residuals.float().abs().mean(0)
        return Payload({"channels": score.topk(self.channels.numel()).indices.sort().values.to(torch.int64)})

    @torch.no_grad()
    def load_init(self, payload: Payload) -> None:
        ch = payload.tensors["channels"]
        if (ch.shape != self.channels.shape or ch.dtype != torch.int64
                or bool(((ch < 0) | (ch >= self.hidden_size)).any())):
            raise ValueError(f"boundary {self.index}: outlier channels {ch.tolist()} do not fit this boundary")
        self.channels.copy_(ch.to(self.channels.device))

    # the rotated tiles -------------------------------------------------------------------------------
    def _coded(self, bits: int) -> bool:
        """Whether codes of ``bits`` cross entropy coded (``entropy``; 1-bit cells are equally likely)."""
        return self.entropy and bits >= 2

    def _pack(self, t: torch.Tensor, bits: int, scale: int) -> dict[str, torch.Tensor]:
        rotated = hadamard(t.float().reshape(-1, self.group)).reshape(-1, scale)  # a token's tiles stay together
        if self.grid == "lloyd-max":
            codes, rms = quantize_rms(rotated, bits, scale)
            if self._coded(bits):
                return {"codes": encode_categorical(codes.cpu(), gaussian_cell_probabilities(bits)).to(t.device),
                        "scale": rms}
            return {"codes": pack_bits(codes, bits), "scale": rms}
        codes, lo, step = quantize(rotated, bits, scale)
        return {"codes": pack_bits(codes, bits), "offset": lo, "step": step}

    def _unpack(self, p: dict[str, torch.Tensor], bits: int, scale: int, tokens: int) -> torch.Tensor:
        """(tokens, H) from the packed codes of ``tokens`` tokens."""
        n = tokens * self.hidden_size
        if self._coded(bits):
            codes = decode_categorical(p["codes"].cpu(), gaussian_cell_probabilities(bits), n,
                                       f"boundary {self.index}").to(p["scale"].device).reshape(-1, scale)
        else:
            codes = unpack_bits(p["codes"], bits, n).reshape(-1, scale)
        if self.grid == "lloyd-max":
            values = dequantize_rms(codes, p["scale"], bits, (-1, self.group))
        else:
            values = dequantize(codes, p["offset"], p["step"], (-1, self.group))
        return hadamard(values).reshape(tokens, self.hidden_size)

    def _kept(self, tokens: int) -> int:
        return math.ceil(self.bwd_tokens * tokens)

    def _select(self, flat: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens whose gradients cross (``bwd_select``) and the factor each is scaled by before coding."""
        key = (self.seed, self.index, ctx.step, ctx.microbatch, ctx.replica) if self.bwd_select == "sample" else ()
        return select_tokens(flat.pow(2).sum(1), self._kept(flat.shape[0]), self.bwd_select, key)

    # sender / receiver ---------------------------------------------------------------------------
    def encode(self, x, ctx):
        if self.compress == "bwd":
            return Boundary.encode(self, x, ctx)
        rest = x.detach().float().clone()
        intact = rest[..., self.channels]
        rest[..., self.channels] = 0.0
        intact = intact.to(self.intact_dtype) if self.intact_dtype is not None else self._to_wire(intact)
        return x, Payload({"intact": intact.reshape(math.prod(x.shape[:-1]), self.channels.numel()),  # (tokens, C)
                           **self._pack(rest, self.fwd_bits, self.scale_group)})

    def decode(self, payload, ctx):
        if self.compress == "bwd":
            return Boundary.decode(self, payload, ctx)
        p = payload.tensors
        shape = (*ctx.input_ids.shape, self.hidden_size)  # both ends know the microbatch's shape
        if self._coded(self.fwd_bits):
            self._check_coded(p, "fwd", math.prod(shape[:-1]))
        x = self._unpack(p, self.fwd_bits, self.scale_group, math.prod(shape[:-1])).reshape(shape)
        x[..., self.channels] = p["intact"].float().reshape(*shape[:-1], -1)
        return x

    def encode_grad(self, g, ctx):
        if self.compress == "fwd":
            return Boundary.encode_grad(self, g, ctx)
        flat = g.detach().float().reshape(-1, self.hidden_size)
        if self.bwd_tokens == 1:
            return Payload(self._pack(flat, self.bwd_bits, self.bwd_scale_group))
        keep, factor = self._select(flat, ctx)
        return Payload({"tokens": pack_bits(keep, 1),
                        **self._pack(flat[keep] * factor[keep, None], self.bwd_bits, self.bwd_scale_group)})

    def decode_grad(self, payload, ctx):
        if self.compress == "fwd":
            return Boundary.decode_grad(self, payload, ctx)
        p = payload.tensors
        shape = (*ctx.input_ids.shape, self.hidden_size)
        n = math.prod(shape[:-1])
        if self._coded(self.bwd_bits):
            self._check_coded(p, "bwd", n)
        if self.bwd_tokens == 1:
            return self._unpack(p, self.bwd_bits, self.bwd_scale_group, n).reshape(shape)
        keep = unpack_bits(p["tokens"], 1, n).bool()
        k = self._kept(n)
        if int(keep.sum()) != k:  # a peer's bitmap must name exactly the K tokens whose codes follow
            raise PayloadError(f"boundary {self.index}: the gradient's token bitmap names {int(keep.sum())} tokens, "
                               f"not {k}")
        g = torch.zeros(n, self.hidden_size, device=p["codes"].device)
        g[keep] = self._unpack(p, self.bwd_bits, self.bwd_scale_group, k)
        return g.reshape(shape)

    def _codes_bytes(self, values: int, bits: int, bound: bool = False) -> int:
        """Bytes of ``values`` codes: packed, or entropy coded (the model's estimate, or with ``bound`` the most a
        receiver accepts)."""
        if not self._coded(bits):
            return packed_bytes(values, bits)
        if bound:
            return max_coded_bytes(values)
        return 4 * (math.ceil(values * categorical_bits(gaussian_cell_probabilities(bits)) / 32) + 3)

    def _codes_spec(self, values: int, bits: int, scale: int) -> dict:
        groups = values // scale
        side = {"scale": ((groups,), RMS_SCALE_DTYPE)} if self.grid == "lloyd-max" else \
            {"offset": ((groups,), SCALE_DTYPE), "step": ((groups,), SCALE_DTYPE)}
        return {"codes": ((packed_bytes(values, bits),), torch.uint8), **side}

    def _spec(self, direction: str, tokens: int) -> dict:
        """The tensors this boundary's encoder sends for ``tokens`` tokens (entropy-coded codes at their packed size:
        ``payload_expect`` bounds those)."""
        n = tokens * self.hidden_size
        if direction == "fwd":
            intact = self.intact_dtype or self.wire_dtype or torch.float32
            return {"intact": ((tokens, self.channels.numel()), intact),
                    **self._codes_spec(n, self.fwd_bits, self.scale_group)}
        k = self._kept(tokens)
        spec = self._codes_spec(k * self.hidden_size, self.bwd_bits, self.bwd_scale_group)
        if self.bwd_tokens < 1:
            spec = {"tokens": ((packed_bytes(tokens, 1),), torch.uint8), **spec}
        return spec

    def _check_coded(self, p: dict, direction: str, tokens: int) -> None:
        """An entropy-coded payload: every tensor but the codes exactly as sent, the codes one stream of bytes."""
        spec = self._spec(direction, tokens)
        got = {k: (tuple(v.shape), v.dtype) for k, v in p.items() if k != "codes"}
        if set(p) != set(spec) or got != {k: v for k, v in spec.items() if k != "codes"} or \
                p["codes"].dtype != torch.uint8 or p["codes"].dim() != 1:
            raise PayloadError(f"boundary {self.index}: the entropy-coded {direction} payload does not match {tokens} "
                               "tokens")

    def payload_expect(self, direction, tokens, ctx=None):
        """Exactly the tensors this boundary's encoder sends for ``tokens`` tokens (a dense direction:
        the base's bound; entropy-coded codes: at most ``max_bytes``), so a peer's malformed payload is refused
        before anything is allocated."""
        if (direction == "fwd" and self.compress == "bwd") or (direction == "bwd" and self.compress == "fwd"):
            return super().payload_expect(direction, tokens)
        spec = self._spec(direction, tokens)
        if self._coded(self.fwd_bits if direction == "fwd" else self.bwd_bits):  # the base's bound: max_bytes
            return Expect(max_bytes=super().payload_expect(direction, tokens).max_bytes,
                          dtypes=frozenset(dt for _, dt in spec.values()))
        return Expect.exactly(spec)

    def _both_bytes(self, tokens: int, element_size: int, bound: bool) -> tuple[int, int]:
        n, dense = tokens * self.hidden_size, tokens * self.hidden_size * element_size
        intact = torch.empty((), dtype=self.intact_dtype).element_size() if self.intact_dtype else element_size
        fwd = tokens * self.channels.numel() * intact + self._codes_bytes(n, self.fwd_bits, bound) + \
            n // self.scale_group * self.scale_bytes
        k = self._kept(tokens) * self.hidden_size
        bwd = self._codes_bytes(k, self.bwd_bits, bound) + k // self.bwd_scale_group * self.scale_bytes
        if self.bwd_tokens < 1:
            bwd += packed_bytes(tokens, 1)
        return dense if self.compress == "bwd" else fwd, dense if self.compress == "fwd" else bwd

    def expected_bytes(self, tokens, element_size):
        return self._both_bytes(tokens, element_size, bound=False)

    def max_bytes(self, tokens, element_size):
        return self._both_bytes(tokens, element_size, bound=True)
