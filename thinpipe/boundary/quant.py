"""Uniform low-bit quantisation of activations and their gradients: the ``quant4`` / ``quant2``
baselines of the anchor-priors paper (Table 4, "4-bit Quant"), and the packing every quantising
boundary (``aqsgd``, ``tahquant``) shares.

Scheme (choices the papers leave open, documented in docs/baselines.md): per group of ``group``
consecutive hidden dims of one token (``group = 0``: the whole token), asymmetric round-to-nearest
onto 2^b levels between the group's min and max. The group's offset and step cross the wire as
bfloat16 (fp16 would flush small gradients' steps to zero); the offset is rounded down and the step
up to bfloat16 before the codes are computed, so every element's error stays within half a step.
Codes are bit-packed (b bits each, no padding but the last byte).

Off-graph (base.py): the sender keeps its activation in the graph (``z = x``), the receiver computes
on the dequantised copy, and the backward quantises the activation gradient independently at
``bwd_bits`` (Table 4's "8/2x" = 2-bit forward, 8-bit backward against a 16-bit wire).
"""

from __future__ import annotations

import math

import torch

from thinpipe.boundary.base import Boundary, Payload, implements
from thinpipe.config.boundary_kinds import Quant2Kind, Quant4Kind

SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2 * 2  # offset + step per group


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2^bits) -> uint8, ``bits`` bits each, little-endian within a byte."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if 8 % bits == 0:  # whole codes per byte: the same layout without one int32 per bit (~10x faster)
        return _pack_whole(codes, bits)
    flat = codes.reshape(-1).to(torch.int32)
    planes = ((flat[:, None] >> torch.arange(bits, dtype=torch.int32, device=flat.device)) & 1).reshape(-1)
    pad = (-planes.numel()) % 8
    if pad:
        planes = torch.cat([planes, planes.new_zeros(pad)])
    return (planes.reshape(-1, 8) << torch.arange(8, dtype=torch.int32, device=flat.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``count`` codes, int64."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[:, None] >> shifts) & (2 ** bits - 1)
        return codes.reshape(-1)[:count].to(torch.int64)
    planes = ((packed.to(torch.int32)[:, None]
               >> torch.arange(8, dtype=torch.int32, device=packed.device)) & 1).reshape(-1)
    planes = planes[:count * bits].reshape(count, bits)
    return (planes << torch.arange(bits, dtype=torch.int32, device=packed.device)).sum(1).to(torch.int64)


def _pack_whole(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits  # codes per byte; code m of a byte sits at bits m*bits .. (m+1)*bits - 1
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
    lanes = flat.reshape(-1, per) << shifts
    out = lanes[:, 0].clone()
    for m in range(1, per):  # the lanes' bits do not overlap: OR is their sum
        out |= lanes[:, m]
    return out


def packed_bytes(count: int, bits: int) -> int:
    return math.ceil(count * bits / 8)


def _round_down(t: torch.Tensor) -> torch.Tensor:
    """To SCALE_DTYPE, never above ``t`` (so the grid's floor stays below every value)."""
    r = t.to(SCALE_DTYPE)
    low = r.float() > t
    if low.any():
        r = torch.where(low, torch.nextafter(r, torch.full_like(r, -math.inf)), r)
    return r


def _round_up(t: torch.Tensor) -> torch.Tensor:
    r = t.to(SCALE_DTYPE)
    high = r.float() < t
    if high.any():
        r = torch.where(high, torch.nextafter(r, torch.full_like(r, math.inf)), r)
    return r


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., H) -> (codes (N, group) int64, offset (N,) bf16, step (N,) bf16), N = numel / group."""
    g = x.detach().float().reshape(-1, group)
    lo = _round_down(g.min(1).values)
    levels = 2 ** bits - 1
    step = _round_up(((g.max(1).values - lo.float()) / levels).clamp_min(1e-30))
    codes = ((g - lo.float()[:, None]) / step.float()[:, None]).round().clamp(0, levels).to(torch.int64)
    return codes, lo, step


def dequantize(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, shape) -> torch.Tensor:
    return (lo.float()[:, None] + codes.float() * step.float()[:, None]).reshape(shape)


def group_size(hidden_size: int, group: int) -> int:
    g = group or hidden_size
    if hidden_size % g:
        raise ValueError(f"boundary.quant_group = {group} must divide the hidden size {hidden_size}")
    return g


@implements(Quant4Kind, Quant2Kind)
class QuantBoundary(Boundary):
    """``quant4`` / ``quant2``: uniform ``fwd_bits`` activations, ``bwd_bits`` gradients."""


    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        b = cls(index, hidden_size, *cfg.bits(), cfg.quant_group, wire_dtype)
        b.spec = cfg.spec()  # quant4 or quant2 (their default bits differ, the class does not)
        return b

    def __init__(self, index: int, hidden_size: int, fwd_bits: int, bwd_bits: int, group: int,
                 wire_dtype: torch.dtype | None = None):
        super().__init__(index, hidden_size, wire_dtype)
        for name, b in (("forward", fwd_bits), ("backward", bwd_bits)):
            if not 1 <= b <= 8:
                raise ValueError(f"{name} bits must be in [1, 8], got {b}")
        self.fwd_bits, self.bwd_bits = fwd_bits, bwd_bits
        self.group = group_size(hidden_size, group)

    # the packed form of one tensor ------------------------------------------------------------
    def pack(self, t: torch.Tensor, bits: int) -> Payload:
        codes, lo, step = quantize(t, bits, self.group)
        return Payload({"codes": pack_bits(codes, bits), "offset": lo, "step": step})

    def unpack(self, payload: Payload, bits: int, ctx) -> torch.Tensor:
        shape = (*ctx.input_ids.shape, self.hidden_size)  # both ends know the microbatch's shape
        codes = unpack_bits(payload.tensors["codes"], bits, math.prod(shape)).reshape(-1, self.group)
        return dequantize(codes, payload.tensors["offset"], payload.tensors["step"], shape)

    def _bytes(self, tokens: int, bits: int) -> int:
        n = tokens * self.hidden_size
        return packed_bytes(n, bits) + n // self.group * SCALE_BYTES

    # sender / receiver ---------------------------------------------------------------------------
    def encode(self, x, ctx):
        return x, self.pack(x, self.fwd_bits)

    def decode(self, payload, ctx):
        return self.unpack(payload, self.fwd_bits, ctx)

    def encode_grad(self, g, ctx):
        return self.pack(g, self.bwd_bits)

    def decode_grad(self, payload, ctx):
        return self.unpack(payload, self.bwd_bits, ctx)

    def expected_bytes(self, tokens, element_size):
        return self._bytes(tokens, self.fwd_bits), self._bytes(tokens, self.bwd_bits)
