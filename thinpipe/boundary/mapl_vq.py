"""MAPL + residual VQ (MAPL §3.5, App. E.4, F): the projected Z and its gradient both travel as codes.

Per token, Z (r values) is scaled to unit RMS; the scale (1 value, wire dtype) and R * r/g codes
(uint8 for K <= 256) cross the wire, plus a streamed slice of the shared codebook per microbatch
(``vq.py``). Gradients use their own codebooks (owned by the receiver, which encodes them). Gradients
are straight-through: the receiver's dL/dZ_hat is applied to the sender's unquantised Z.
During evaluation (no grad) the codebooks neither learn nor sync: both ends decode with the same
shared codebook, so evaluation leaves the protocol state untouched.
"""

from __future__ import annotations

import torch

from thinpipe.boundary.base import Payload, implements
from thinpipe.boundary.mapl import MaplBoundary, id_dtype
from thinpipe.boundary.vq import StreamingCodebook, code_dtype
from thinpipe.config.boundary_kinds import MaplVQKind


def _unit_rms(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = t.reshape(-1, t.shape[-1]).float()
    scale = flat.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    return flat / scale, scale


@implements(MaplVQKind)
class MaplVQBoundary(MaplBoundary):
    forward_state = True  # its forward updates its state (base.py)

    @classmethod
    def from_config(cls, cfg, index, hidden_size, seed, wire_dtype, model, shared):
        own, emb = cfg.settings(), model.get_input_embeddings().weight
        return cls(index, hidden_size, cfg.rank, emb.shape[0], emb, seed, **cls._options(cfg, wire_dtype),
                   codes=own.codes, rounds=own.rounds, group_size=own.group_size, sync_codes=own.sync_codes,
                   decay=own.decay)

    def __init__(self, *args, codes: int = 256, rounds: int = 2, group_size: int = 2, sync_codes: int = 1,
                 decay: float = 0.95, **kwargs):
        super().__init__(*args, **kwargs)
        seed = 104729 * (self.index + 1)
        self.fwd_vq = StreamingCodebook(self.rank, group_size, codes, rounds, sync_codes, decay, seed)
        self.bwd_vq = StreamingCodebook(self.rank, group_size, codes, rounds, sync_codes, decay, seed + 1)
        self.codes, self.rounds, self.group_size, self.sync_codes = codes, rounds, group_size, sync_codes

    def _pack(self, vq: StreamingCodebook, t: torch.Tensor, training: bool) -> Payload:
        u, scale = _unit_rms(t)
        codes, slice_ = vq.sender_encode(u, learn=training, sync=training)
        value_dtype = self.wire_dtype or torch.float32
        tensors = {"codes": codes.to(code_dtype(self.codes)), "scale": scale.squeeze(-1).to(value_dtype)}
        if slice_ is not None:
            tensors["codebook"] = slice_.to(value_dtype)
        return Payload(tensors)

    def _unpack(self, vq: StreamingCodebook, payload: Payload, ctx) -> torch.Tensor:
        t = payload.tensors
        u = vq.receiver_decode(t["codes"].long(), t.get("codebook"))
        return (u * t["scale"].float().unsqueeze(-1)).reshape(*ctx.input_ids.shape, self.rank)

    def encode(self, x, ctx):
        offset = self.sender_offset(ctx.input_ids)
        z = (x if offset is None else x - offset) @ self.projector.A
        payload = self._pack(self.fwd_vq, z.detach(), training=torch.is_grad_enabled())
        payload.tensors["ids"] = ctx.input_ids.to(id_dtype(self.vocab_size))
        return z, payload

    def decode(self, payload, ctx):
        return self._unpack(self.fwd_vq, payload, ctx)

    def encode_grad(self, g, ctx):
        return self._pack(self.bwd_vq, g, training=True)

    def decode_grad(self, payload, ctx):
        return self._unpack(self.bwd_vq, payload, ctx)

    def receiver_keeps(self, key: str) -> bool:
        """The forward codebooks decode on the receiving end, the gradients' on the sending end."""
        book, _, name = key.partition(".")
        if book not in ("fwd_vq", "bwd_vq"):
            return super().receiver_keeps(key)
        return (name in StreamingCodebook.DECODER_STATE) == (book == "fwd_vq")

    def expected_bytes(self, tokens, element_size):
        """Per microbatch of ``tokens`` tokens while training (one codebook slice per direction)."""
        groups = self.rank // self.group_size
        codes = tokens * self.rounds * groups * torch.empty(0, dtype=code_dtype(self.codes)).element_size()
        scale = tokens * element_size
        slice_ = self.rounds * groups * self.sync_codes * self.group_size * element_size
        ids = tokens * torch.empty(0, dtype=id_dtype(self.vocab_size)).element_size()
        return codes + scale + slice_ + ids, codes + scale + slice_
