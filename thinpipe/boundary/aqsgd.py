"""AQ-SGD (Wang et al. 2022, "Fine-tuning language models over slow networks using activation
quantization with guarantees"): quantise the *change* of each example's activation.

Both ends keep, per training example xi, a buffer m(xi) of the activation they last agreed on:

    first visit:  send a(xi) densely (wire dtype);              m(xi) = a(xi)
    revisit:      q = Q_b(a(xi) - m(xi)); send q;               m(xi) += deq(q)   (both ends)
    receiver uses x_hat = m(xi)

so the quantisation error does not accumulate over epochs (error feedback through m) and, as
training converges and a(xi) stops moving, the deltas shrink and so does their error. The backward
quantises the activation gradient directly at ``bwd_bits`` (no buffer: gradients are not
revisited). An "example" is a packed row of the batch, identified by a hash of its token ids
(every stage reads the same batch, so both ends key it identically without sending anything, and
both know which rows are new from their own buffers).

The buffers cost memory at both ends: rows seen x T x H x 4 bytes each (``memory_bytes``, reported
in the run's summary), the overhead TAH-Quant was designed to avoid. They are saved in checkpoints
(``get_extra_state``). In simulation one object holds both ends, so it keeps the sender's and the
receiver's buffers apart (``sent`` / ``received``); they stay equal by construction (tested).
"""

from __future__ import annotations

import hashlib

import torch

from thinpipe.boundary.base import Payload, implements
from thinpipe.boundary.quant import QuantBoundary, dequantize, pack_bits, quantize, unpack_bits
from thinpipe.config.boundary_kinds import AqsgdKind


def row_keys(input_ids: torch.Tensor) -> list[str]:
    """One key per row of the microbatch: a hash of its token ids."""
    ids = input_ids.detach().to(torch.int64).cpu()
    return [hashlib.blake2b(row.numpy().tobytes(), digest_size=12).hexdigest() for row in ids]


@implements(AqsgdKind)
class AqsgdBoundary(QuantBoundary):
    forward_state = True  # its forward updates its state (base.py)

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.sent: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] = {}

    # sender ---------------------------------------------------------------------------------------
    def encode(self, x, ctx):
        keys = row_keys(ctx.input_ids)
        a = x.detach().float()
        new = torch.tensor([k not in self.sent for k in keys], device=x.device)
        tensors = {}
        if new.any():
            tensors["dense"] = self._to_wire(x[new])
            for k, row in zip((k for k, n in zip(keys, new.tolist()) if n), tensors["dense"].float()):
                self.sent[k] = row.clone()  # what the receiver will hold: the wire's rounding included
        old = ~new
        if old.any():
            old_keys = [k for k, n in zip(keys, new.tolist()) if not n]
            m = torch.stack([self.sent[k] for k in old_keys]).to(a.device)  # a checkpoint loads on the CPU
            codes, lo, step = quantize(a[old] - m, self.fwd_bits, self.group)
            delta = dequantize(codes, lo, step, m.shape)
            for k, row in zip(old_keys, m + delta):
                self.sent[k] = row
            tensors.update(codes=pack_bits(codes, self.fwd_bits), offset=lo, step=step)
        return x, Payload(tensors)

    # receiver -------------------------------------------------------------------------------------
    def decode(self, payload, ctx):
        keys = row_keys(ctx.input_ids)
        t = payload.tensors
        # the receiver's buffers hold the same rows as the sender's: new-ness needs no flag
        device = next(iter(t.values())).device
        new = torch.tensor([k not in self.received for k in keys], device=device)
        out = torch.empty(*ctx.input_ids.shape, self.hidden_size, device=device)
        if new.any():
            dense = t["dense"].float()
            out[new] = dense
            for k, row in zip((k for k, n in zip(keys, new.tolist()) if n), dense):
                self.received[k] = row.clone()
        old = ~new
        if old.any():
            old_keys = [k for k, n in zip(keys, new.tolist()) if not n]
            m = torch.stack([self.received[k] for k in old_keys]).to(device)
            codes = unpack_bits(t["codes"], self.fwd_bits, m.numel()).reshape(-1, self.group)
            updated = m + dequantize(codes, t["offset"], t["step"], m.shape)
            for k, row in zip(old_keys, updated):
                self.received[k] = row
            out[old] = updated
        return out

    # accounting and state -------------------------------------------------------------------------
    def expected_bytes(self, tokens, element_size):
        """Every row revisited (the steady state: ``quant``'s formula); a first visit sends the row
        densely instead."""
        return super().expected_bytes(tokens, element_size)

    def max_bytes(self, tokens, element_size):
        """A microbatch mixes first visits (dense rows) and revisits (codes): at most both in full."""
        fwd, bwd = self.expected_bytes(tokens, element_size)
        return fwd + tokens * self.hidden_size * element_size, bwd

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.sent, self.received) for t in d.values())

    def get_extra_state(self):
        return {"sent": self.sent, "received": self.received}

    def merged_state(self, sender: dict, receiver: dict) -> dict:
        """The buffers of what was sent from the sending end, of what arrived from the receiving end."""
        out = super().merged_state(sender, receiver)
        if "_extra_state" in sender and "_extra_state" in receiver:
            out["_extra_state"] = {"sent": sender["_extra_state"]["sent"],
                                   "received": receiver["_extra_state"]["received"]}
        return out

    def set_extra_state(self, state) -> None:
        self.sent, self.received = dict(state["sent"]), dict(state["received"])
