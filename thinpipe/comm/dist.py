"""Point-to-point payload transport over torch.distributed (gloo on CPU, NCCL on GPU).

The same ``send(tag, payload, axis)`` / ``recv(tag)`` interface as the in-process ``Mailbox``, so
a stage worker runs unchanged; ``route(tag)`` names the peer rank of a tag and ``channel(tag)``
its message kind (forward activation, backward gradient, parameter sync), which becomes the
torch.distributed tag so that the kinds never cross. Each message is the header of ``wire.py`` then
every tensor as raw bytes (any dtype crosses bit-exactly, integer payloads included). Sends are
asynchronous (``isend``): a stage never deadlocks against a neighbour that is sending to it at the
same time (1F1B); ``flush()`` waits for them. Bytes are metered per axis from the payload, as in the
simulation; the header overhead is counted apart in ``header_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from thinpipe.boundary.base import Payload
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.shaped import ShapedLink
from thinpipe.comm.wire import HEADER_BYTES, HEADER_SLOTS, decode_header, encode_header


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


class DistTransport:
    def __init__(self, route: Callable[[Hashable], int], channel: Callable[[Hashable], int], meter: ByteMeter,
                 links: dict[str, ShapedLink] | None = None, group=None):
        self.route, self.channel, self.meter = route, channel, meter
        self.links = links or {}
        self.group = group
        self.header_bytes = 0
        self._pending: list[tuple[object, torch.Tensor]] = []

    def send(self, tag: Hashable, payload: Payload, axis: str) -> None:
        peer, ch = self.route(tag), self.channel(tag)
        link = self.links.get(axis)
        if link is not None:
            link.wait(payload.nbytes + HEADER_BYTES)
        parts = [encode_header(payload)] + [_as_bytes(t) for t in payload.tensors.values()]
        for part in parts:
            self._pending.append((dist.isend(part, peer, group=self.group, tag=ch), part))
        self.meter.add(axis, payload.nbytes)
        self.header_bytes += HEADER_BYTES

    def recv(self, tag: Hashable) -> Payload:
        peer, ch = self.route(tag), self.channel(tag)
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64)
        dist.recv(header, peer, group=self.group, tag=ch)
        tensors = {}
        for name, dtype, shape in decode_header(header):
            n = 1
            for d in shape:
                n *= d
            raw = torch.empty(n * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8)
            dist.recv(raw, peer, group=self.group, tag=ch)
            t = raw.view(dtype) if dtype != torch.bool else raw.to(torch.bool)
            tensors[name] = t.reshape(shape)
        return Payload(tensors)

    def flush(self) -> None:
        """Wait for every send posted so far (their buffers may then be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
