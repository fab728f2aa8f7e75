"""Point-to-point payload transport over torch.distributed (gloo; CPU tensors).

The same ``send(tag, payload, axis)`` / ``recv(tag)`` interface as the in-process ``Mailbox``, so
a stage worker runs unchanged; ``route(tag)`` names the peer rank of a tag and ``channel(tag)``
its message kind (forward activation, backward gradient, parameter sync), which becomes the
torch.distributed tag so that the kinds never cross. Each message is the header of ``wire.py`` then
every tensor as raw bytes (any dtype crosses bit-exactly, integer payloads included). Sends are
asynchronous (``isend``): a stage never deadlocks against a neighbour that is sending to it at the
same time (1F1B); ``flush()`` waits for them. Bytes are metered per axis from the payload, as in the
simulation; the header overhead is counted apart in ``header_bytes``.

Shaped links (``link_for(axis, peer)`` returns a ``ShapedLink`` or None): the message is handed to
a sender thread that holds it for the link's transfer time and latency before posting it, so the
stage computes on while its message is "on the wire", as with a real NIC; messages to one peer
keep their order.
"""

from __future__ import annotations

import queue
import threading
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
                 link_for: Callable[[str, int], ShapedLink | None] | None = None, group=None,
                 background: bool = False):
        """``background``: every send goes through the sender thread, which also waits for it to
        complete, so ``idle()`` can tell without blocking whether anything is still on its way
        (gloo's ``Work.is_completed`` never turns true for point-to-point operations)."""
        self.route, self.channel, self.meter = route, channel, meter
        self.link_for = link_for or (lambda axis, peer: None)
        self.group = group
        self.background = background
        self.header_bytes = 0
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._error: BaseException | None = None

    def _post(self, peer: int, ch: int, parts: list[torch.Tensor]) -> None:
        works = [(dist.isend(part, peer, group=self.group, tag=ch), part) for part in parts]
        with self._lock:
            self._pending.extend(works)

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            link, nbytes, peer, ch, parts = item
            try:
                if link is not None:
                    link.wait(nbytes)
                self._post(peer, ch, parts)
                if self.background:
                    with self._lock:
                        pending, self._pending = self._pending, []
                    for work, _ in pending:
                        work.wait()
            except BaseException as e:  # surfaced by flush() on the main thread
                self._error = e
            finally:
                self._queue.task_done()

    def send(self, tag: Hashable, payload: Payload, axis: str | None, metered: int | None = None) -> None:
        """``metered``: the bytes to count on ``axis`` when part of the payload is protocol (a step
        number, say) rather than data the simulation counts; None = the whole payload."""
        peer, ch = self.route(tag), self.channel(tag)
        parts = [encode_header(payload)] + [_as_bytes(t) for t in payload.tensors.values()]
        link = self.link_for(axis, peer)
        if link is None and not self.background:
            self._post(peer, ch, parts)
        else:
            if self._queue is None:
                self._queue = queue.Queue()
                threading.Thread(target=self._sender, daemon=True, name="thinpipe-link").start()
            self._queue.put((link, payload.nbytes + HEADER_BYTES, peer, ch, parts))
        if axis is not None:
            self.meter.add(axis, payload.nbytes if metered is None else metered)
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

    def idle(self) -> bool:
        """Nothing queued or in flight (meaningful with ``background``)."""
        return self._queue is None or self._queue.unfinished_tasks == 0

    def flush(self) -> None:
        """Wait for every send handed over so far to be posted and completed."""
        if self._queue is not None:
            self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"a shaped send failed: {self._error}") from self._error
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
