"""``outlier``: calibrated outlier channels sent intact, the rest Hadamard-rotated and quantised
(issue 17's frontier; not in either paper).

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

Two byte savers for the forward (issue 17's frontier): ``outlier_scale_group`` = S dims share one
offset and step (S a multiple of G dividing H; S = H, or -1, is one pair per token: 36 -> 4 B per
token at H = 576, G = 64), and ``outlier_dtype = bfloat16`` sends the intact channels in bf16 whatever the
wire (fp32 wire: 64 -> 32 B at C = 16). The backward keeps one pair per tile: its 1-bit codes need
the tile's own range.

Bytes per token (forward, backward): C x intact bytes + H x fwd_bits / 8 + (H / S) x 4, and
H x bwd_bits / 8 + (H / G) x 4 (``expected_bytes``; tests check them against the meter).
"""

from __future__ import annotations

import math

import torch

from thinpipe.boundary.base import Payload
from thinpipe.boundary.quant import SCALE_BYTES, QuantBoundary, dequantize, pack_bits, packed_bytes, quantize, \
    unpack_bits
from thinpipe.boundary.tahquant import hadamard


class OutlierBoundary(QuantBoundary):
    kind = "outlier"

    def __init__(self, index: int, hidden_size: int, channels: int, fwd_bits: int, bwd_bits: int, group: int,
                 wire_dtype: torch.dtype | None = None, scale_group: int = 0, intact_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, fwd_bits, bwd_bits, group, wire_dtype)
        if self.group & (self.group - 1):
            raise ValueError(f"outlier tiles are Hadamard-rotated: boundary.quant_group must be a power of two, got "
                             f"{self.group}")
        self.scale_group = hidden_size if scale_group == -1 else scale_group or self.group
        if self.scale_group % self.group or hidden_size % self.scale_group:
            raise ValueError(f"boundary.outlier_scale_group = {scale_group} must be a multiple of the tile "
                             f"(boundary.quant_group = {self.group}) that divides the hidden size {hidden_size}")
        self.intact_dtype = intact_dtype  # None: the wire dtype
        if not 0 <= channels < hidden_size:
            raise ValueError(f"boundary.outlier_channels must be in [0, {hidden_size}), got {channels}")
        # Until the residual start calibrates them: the first C channels (a start, never a result).
        self.register_buffer("channels", torch.arange(channels, dtype=torch.int64))

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
        if ch.shape != self.channels.shape or ch.dtype != torch.int64 or bool(((ch < 0) | (ch >= self.hidden_size)).any()):
            raise ValueError(f"boundary {self.index}: outlier channels {ch.tolist()} do not fit this boundary")
        self.channels.copy_(ch.to(self.channels.device))

    # the rotated tiles -------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor, bits: int, scale: int) -> dict[str, torch.Tensor]:
        rotated = hadamard(t.float().reshape(-1, self.group)).reshape(-1, scale)  # a token's tiles stay together
        codes, lo, step = quantize(rotated, bits, scale)
        return {"codes": pack_bits(codes, bits), "offset": lo, "step": step}

    def _unpack(self, p: dict[str, torch.Tensor], bits: int, scale: int, ctx) -> torch.Tensor:
        shape = (*ctx.input_ids.shape, self.hidden_size)
        codes = unpack_bits(p["codes"], bits, math.prod(shape)).reshape(-1, scale)
        return hadamard(dequantize(codes, p["offset"], p["step"], (-1, self.group))).reshape(shape)

    # sender / receiver ---------------------------------------------------------------------------
    def encode(self, x, ctx):
        rest = x.detach().float().clone()
        intact = rest[..., self.channels]
        rest[..., self.channels] = 0.0
        intact = intact.to(self.intact_dtype) if self.intact_dtype is not None else self._to_wire(intact)
        return x, Payload({"intact": intact, **self._pack(rest, self.fwd_bits, self.scale_group)})

    def decode(self, payload, ctx):
        p = payload.tensors
        x = self._unpack(p, self.fwd_bits, self.scale_group, ctx)
        x[..., self.channels] = p["intact"].float()
        return x

    def encode_grad(self, g, ctx):
        return Payload(self._pack(g, self.bwd_bits, self.group))

    def decode_grad(self, payload, ctx):
        return self._unpack(payload.tensors, self.bwd_bits, self.group, ctx)

    def expected_bytes(self, tokens, element_size):
        n = tokens * self.hidden_size
        intact = torch.empty((), dtype=self.intact_dtype).element_size() if self.intact_dtype else element_size
        return (tokens * self.channels.numel() * intact + packed_bytes(n, self.fwd_bits)
                + n // self.scale_group * SCALE_BYTES,
                packed_bytes(n, self.bwd_bits) + n // self.group * SCALE_BYTES)
