"""Authenticated (and, with ``wire.encrypt``, sealed) point-to-point messages (docs/security.md).

Every message of a ``DistTransport`` is a frame (``header.py``'s header + two HMAC-SHA256 tags) and
its body. Both tags are keyed by the job key's sub-key for this transport and cover the link's
identity and the message's number on it::

    ad        = sender rank | receiver rank | channel | n   (n: 0, 1, 2, ... per link and channel)
    body tag  = HMAC(k_mac, "body", ad, tensor bytes...)   (all zero when sealed: the AEAD tag covers it)
    head tag  = HMAC(k_mac, "head", ad, header, body tag)

The receiver knows which message number comes next, so a payload made without the key, one
replayed from earlier on this link, or one moved from another link or channel fails its tag and
is refused in one line naming the peer. The header is checked first, before the receiver
allocates what it describes (``Expect``); the body after it arrives.

Sealed (``wire.encrypt = true``): the tensors travel as one ChaCha20-Poly1305 ciphertext (the
``cryptography`` package), keyed per link and channel, nonce = n, the header as associated data;
the 16-byte AEAD tag is counted with the frame's overhead. Headers (names, dtypes, shapes) stay in
the clear: they say how big a message is, which its length on the wire says anyway.
"""

from __future__ import annotations

import struct
from collections import defaultdict

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from thinpipe.comm.header import AUTH_SLOTS, HEADER_SLOTS, PayloadError
from thinpipe.comm.jobkey import MAC_BYTES, derive, mac, same

SEAL_TAG_BYTES = 16  # Poly1305


def _bytes(t: torch.Tensor) -> memoryview:
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12; it has it on 3.11 too
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


class LinkAuth:
    """One transport's keys and per-link message numbers (both directions)."""

    def __init__(self, key: bytes, label: str, me: int, encrypt: bool = False):
        self.me, self.encrypt = me, encrypt
        self._mac_key = derive(key, f"pp-mac/{label}")
        self._seal_root = derive(key, f"pp-seal/{label}") if encrypt else None
        self._sealers: dict[tuple[int, int, int], object] = {}
        self._sent: dict[tuple[int, int], int] = defaultdict(int)
        self._received: dict[tuple[int, int], int] = defaultdict(int)

    def _sealer(self, src: int, dst: int, ch: int):
        k = (src, dst, ch)
        if k not in self._sealers:
            assert self._seal_root is not None  # only a sealing transport (encrypt) asks for a sealer
            self._sealers[k] = ChaCha20Poly1305(derive(self._seal_root, f"{src}/{dst}/{ch}"))
        return self._sealers[k]

    @staticmethod
    def _ad(src: int, dst: int, ch: int, n: int) -> bytes:
        return struct.pack("<qqqq", src, dst, ch, n)

    def body_bytes(self, sizes: list[int]) -> list[int]:
        """The byte lengths of the body messages that carry tensors of ``sizes`` bytes."""
        return [sum(sizes) + SEAL_TAG_BYTES] if self.encrypt else sizes

    # sender -------------------------------------------------------------------------------------
    def seal(self, peer: int, ch: int, header: torch.Tensor, parts: list[torch.Tensor]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(frame, body messages) for ``header`` (int64) and ``parts`` (uint8 tensors) sent to ``peer``."""
        n = self._sent[(peer, ch)]
        self._sent[(peer, ch)] = n + 1
        ad, head = self._ad(self.me, peer, ch, n), _bytes(header)
        if self.encrypt:
            data = _bytes(parts[0]) if len(parts) == 1 else b"".join(_bytes(p) for p in parts)
            nonce = n.to_bytes(12, "little")
            body = [torch.frombuffer(bytearray(self._sealer(self.me, peer, ch).encrypt(nonce, data, ad + bytes(head))),
                                     dtype=torch.uint8)]
            body_tag = bytes(MAC_BYTES)
        else:
            body = parts
            body_tag = mac(self._mac_key, b"body", ad, *[_bytes(p) for p in parts])
        head_tag = mac(self._mac_key, b"head", ad, head, body_tag)
        tags = torch.frombuffer(bytearray(body_tag + head_tag), dtype=torch.int64)
        return torch.cat([header, tags]), body

    # receiver -----------------------------------------------------------------------------------
    def _refuse(self, peer: int, ch: int, what: str) -> PayloadError:
        return PayloadError(f"a payload from rank {peer} (channel {ch}) failed authentication ({what}): it was "
                            "injected, replayed or sent with another job key; refused")

    def open_header(self, peer: int, ch: int, frame: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The header of a received ``frame``, once its tag proves it; and what ``open_body`` needs."""
        n = self._received[(peer, ch)]
        header, tags = frame[:HEADER_SLOTS], frame[HEADER_SLOTS:HEADER_SLOTS + AUTH_SLOTS]
        raw = bytes(_bytes(tags))
        body_tag, head_tag = raw[:MAC_BYTES], raw[MAC_BYTES:]
        ad, head = self._ad(peer, self.me, ch, n), _bytes(header)
        if not same(head_tag, mac(self._mac_key, b"head", ad, head, body_tag)):
            raise self._refuse(peer, ch, "header")
        self._received[(peer, ch)] = n + 1
        return header, (n, ad, bytes(head), body_tag)

    def open_body(self, peer: int, ch: int, ticket, body: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """The tensors' bytes (one uint8 tensor per tensor of the header) from the received ``body``."""
        n, ad, head, body_tag = ticket
        if not self.encrypt:
            if not same(body_tag, mac(self._mac_key, b"body", ad, *[_bytes(p) for p in body])):
                raise self._refuse(peer, ch, "body")
            return body
        try:
            plain = self._sealer(peer, self.me, ch).decrypt(n.to_bytes(12, "little"), _bytes(body[0]), ad + head)
        except InvalidTag:
            raise self._refuse(peer, ch, "sealed body") from None
        view, out, at = memoryview(plain), [], 0
        for size in sizes:  # each tensor in its own writable storage, so it can be viewed as its dtype
            out.append(torch.frombuffer(bytearray(view[at:at + size]), dtype=torch.uint8) if size else
                       torch.empty(0, dtype=torch.uint8))
            at += size
        return out
