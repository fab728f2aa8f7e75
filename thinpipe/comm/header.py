"""A payload on a real link: a fixed-size header describing its tensors, then the tensors.

The header (``HEADER_SLOTS`` int64) carries a magic number, the tensor count, and per tensor its
name, dtype and shape, so the receiver allocates exactly what arrives and can refuse anything
malformed (unknown dtype, absurd size, a spec other than the one it expects) with an error instead
of reading garbage. Payload bytes (what the byte meter counts, as in the simulation) exclude the
header; ``HEADER_BYTES`` per message is the protocol's overhead, reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinpipe.comm.payload import Payload

MAGIC = 0x7468696E70697065  # "thinpipe"
MAX_TENSORS = 8
MAX_NDIM = 6
NAME_SLOTS = 4                # 32 bytes of UTF-8 name
PER_TENSOR = 2 + MAX_NDIM + NAME_SLOTS
HEADER_SLOTS = 3 + MAX_TENSORS * PER_TENSOR
AUTH_SLOTS = 8                # two HMAC-SHA256 tags (the body's, then the header's): comm/wire_auth.py
FRAME_SLOTS = HEADER_SLOTS + AUTH_SLOTS
HEADER_BYTES = FRAME_SLOTS * 8  # what a point-to-point message costs beyond its payload
MAX_PAYLOAD_BYTES = 2 ** 33   # 8 GiB: anything larger is a corrupt header, not a payload

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16, torch.uint8,
          torch.int8, torch.bool, torch.float64]
CODE = {dt: i for i, dt in enumerate(DTYPES)}


def nbytes(dtype: torch.dtype, shape) -> int:
    """The bytes a tensor of ``dtype`` and ``shape`` holds."""
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty(0, dtype=dtype).element_size()


class PayloadError(RuntimeError):
    """A received payload is malformed or not what the receiver expects."""


def _name_slots(name: str) -> list[int]:
    raw = name.encode()
    if len(raw) > NAME_SLOTS * 8:
        raise ValueError(f"payload tensor name {name!r} is longer than {NAME_SLOTS * 8} bytes")
    raw = raw.ljust(NAME_SLOTS * 8, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _name(slots: list[int]) -> str:
    raw = b"".join(int(s).to_bytes(8, "little", signed=True) for s in slots).rstrip(b"\0")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise PayloadError(f"payload header holds a tensor name that is not UTF-8 ({raw[:32]!r})") from None


def encode_header(payload: Payload) -> torch.Tensor:
    items = list(payload.tensors.items())
    if len(items) > MAX_TENSORS:
        raise ValueError(f"a payload holds at most {MAX_TENSORS} tensors, got {len(items)}")
    h = [MAGIC, len(items), payload.nbytes]
    for name, t in items:
        if t.dtype not in CODE or t.ndim > MAX_NDIM:
            raise ValueError(f"payload tensor {name!r}: dtype {t.dtype} / {t.ndim} dims not supported on the wire")
        h += [CODE[t.dtype], t.ndim] + list(t.shape) + [0] * (MAX_NDIM - t.ndim) + _name_slots(name)
    h += [0] * (HEADER_SLOTS - len(h))
    return torch.tensor(h, dtype=torch.int64)


def decode_header(h: torch.Tensor) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """-> [(name, dtype, shape)]; raises PayloadError on anything inconsistent."""
    v = h.tolist()
    if len(v) != HEADER_SLOTS or v[0] != MAGIC:
        raise PayloadError("payload header has the wrong magic number: the peer is not speaking this protocol "
                           "(or the stream is out of step)")
    n, total = v[1], v[2]
    if not 0 <= n <= MAX_TENSORS or not 0 <= total <= MAX_PAYLOAD_BYTES:
        raise PayloadError(f"payload header claims {n} tensors / {total} bytes")
    spec, size = [], 0
    for k in range(n):
        f = v[3 + k * PER_TENSOR: 3 + (k + 1) * PER_TENSOR]
        code, ndim = f[0], f[1]
        if not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_NDIM:
            raise PayloadError(f"payload tensor {k}: unknown dtype code {code} or {ndim} dims")
        shape = tuple(f[2:2 + ndim])
        if any(d < 0 for d in shape):
            raise PayloadError(f"payload tensor {k}: negative dimension in {shape}")
        dtype = DTYPES[code]
        size += nbytes(dtype, shape)
        spec.append((_name(f[2 + MAX_NDIM:]), dtype, shape))
    if size != total:
        raise PayloadError(f"payload header is inconsistent: its tensors hold {size} bytes, it claims {total}")
    return spec


FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})
CODES = frozenset({torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool})
WIRE_DTYPES = FLOATS | CODES  # what a boundary's payload may hold (float64 never crosses a PP link)


@dataclass(frozen=True)
class Expect:
    """What a receiver accepts on one receive, checked against the peer's header before anything is
    allocated (docs/security.md): the exact tensors (``spec``: name -> (shape, dtype)) where the
    receiver knows them, else at most ``max_bytes`` of payload in tensors of ``dtypes``. A kind whose
    payload length depends on the data declares an upper bound here, never an estimate."""

    max_bytes: int
    dtypes: frozenset = WIRE_DTYPES
    spec: dict | None = None

    @classmethod
    def exactly(cls, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> "Expect":
        total = sum(nbytes(dtype, shape) for shape, dtype in spec.values())
        return cls(max_bytes=total, dtypes=frozenset(dt for _, dt in spec.values()), spec=dict(spec))

    @classmethod
    def like(cls, payload: Payload) -> "Expect":
        """Exactly the tensors of ``payload`` (a receiver that holds a copy of what it receives)."""
        return cls.exactly(payload.spec())

    def check(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]], where: str) -> None:
        """Refuse a received spec (from ``decode_header``) that is not what this receiver accepts."""
        if self.spec is not None:
            got = {name: (tuple(shape), dtype) for name, dtype, shape in spec}
            if got != self.spec:
                raise PayloadError(f"{where}: the peer sent {_describe(got)} where {_describe(self.spec)} was "
                                   "expected; refused before allocating it")
            return
        size = 0
        for name, dtype, shape in spec:
            if dtype not in self.dtypes:
                raise PayloadError(f"{where}: the peer sent {name!r} as {dtype}, which this receiver never accepts")
            size += nbytes(dtype, shape)
        if size > self.max_bytes:
            raise PayloadError(f"{where}: the peer sent {size} bytes where at most {self.max_bytes} are expected; "
                               "refused before allocating them")


def _describe(spec: dict) -> str:
    return ", ".join(f"{k} {tuple(s)} {str(d).replace('torch.', '')}" for k, (s, d) in spec.items()) or "nothing"


def spec_of(payload: Payload) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``payload``'s tensors in ``decode_header``'s form (so the in-process mailbox checks as a wire would)."""
    return [(k, t.dtype, tuple(t.shape)) for k, t in payload.tensors.items()]
