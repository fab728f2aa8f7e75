"""Point-to-point payload transport over torch.distributed (gloo: host tensors on the wire).

The ``Transport`` of ``protocols.py`` (``send(tag, payload, axis)``, ``recv(tag, expect)``,
``flush()``), as the in-process ``Mailbox``, so a stage worker runs unchanged; a tag (``tags.py``)
names its peer rank (the other end of its link in the mesh layout) and its channel (forward
activation, backward gradient, parameter sync, ...), which becomes the torch.distributed tag so that
the kinds never cross; any other tag is refused. Each message is the header of ``header.py`` then
every tensor as raw bytes (any dtype crosses bit-exactly, integer payloads included). Sends are
asynchronous (``isend``): a stage never deadlocks against a neighbour that is sending to it at the
same time (1F1B); ``flush()`` waits for them. Bytes are metered per axis from the payload, as in the
simulation; the header overhead is counted apart in ``header_bytes``.

Shaped links (``link_for(axis, peer)`` returns a ``ShapedLink`` or None): at hand-over the link
books the message's arrival time (transfer queued behind the link's earlier messages, plus the
latency) and a sender thread (``DueQueue``) posts it then, so the stage computes on while its
message is "on the wire" as with a real NIC, messages in flight overlap their latencies, and
messages on one link keep their order (``link_for`` gives one link per peer for every shaped
axis; an unshaped message is posted at once). The link carries the header too: it is on a real wire.

Every message is authenticated with the job key (``wire_auth.py``: a forged, replayed or moved
message is refused naming the peer), sealed too with ``encrypt``; and the receiver says what it
accepts (``recv(tag, expect)``, ``header.Expect``): a header that describes anything else is refused
before anything is allocated.

A rank that computes on a GPU (``device``) stages each tensor to pinned host memory on send and
moves what it receives to its device (``staging.py``); the bytes, headers and tags are a CPU rank's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from thinpipe.comm.header import FRAME_SLOTS, HEADER_BYTES, HEADER_SLOTS, Expect, decode_header, encode_header
from thinpipe.comm.jobkey import job_key
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.payload import Payload
from thinpipe.comm.protocols import Transport
from thinpipe.comm.shaped import DueQueue, ShapedLink
from thinpipe.comm.staging import to_device, to_host
from thinpipe.comm.tags import Tag, check_tag
from thinpipe.comm.wire_auth import SEAL_TAG_BYTES, LinkAuth


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _posted(work: dist.Work | None) -> dist.Work:
    """``isend``'s handle: None only on a rank outside the group, which a transport's own rank never is."""
    assert work is not None
    return work


class DistTransport(Transport):
    def __init__(self, layout, me: int, meter: ByteMeter,
                 link_for: Callable[[str | None, int], ShapedLink | None] | None = None, group=None,
                 background: bool = False, device: torch.device | None = None, *, key: bytes, label: str,
                 encrypt: bool = False):
        """``background``: every send goes through the sender thread, which also waits for it to
        complete, so ``idle()`` can tell without blocking whether anything is still on its way
        (gloo's ``Work.is_completed`` never turns true for point-to-point operations). ``key``: the
        job key; ``label`` names this transport (its messages cannot be replayed on another one);
        ``encrypt``: seal the payloads (``wire.encrypt``)."""
        self.layout, self.me, self.meter = layout, me, meter
        self.auth = LinkAuth(key, label, me, encrypt)
        self.overhead_bytes = HEADER_BYTES + (SEAL_TAG_BYTES if encrypt else 0)
        self.link_for = link_for or (lambda axis, peer: None)
        self.group = group
        self.background, self.device = background, device
        self.header_bytes = 0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # posted sends and the bytes they hold
        self._lock = threading.Lock()
        self._sender: DueQueue[tuple[int, int, list[torch.Tensor], tuple]] | None = None
        # per peer over a shaped link: [bytes, seconds on the link, when its last message left]: ``link_rates``
        self._rates: dict[int, list[float]] = {}

    def _post(self, peer: int, ch: int, parts: list[torch.Tensor]) -> None:
        works = [(_posted(dist.isend(part, peer, group=self.group, tag=ch)), part) for part in parts]
        with self._lock:
            self._pending.extend(works)

    def _deliver(self, item: tuple[int, int, list[torch.Tensor], tuple]) -> None:
        """On the sender thread, at the message's due time."""
        peer, ch, parts, (nbytes, handed, latency_s) = item
        self._post(peer, ch, parts)
        if self.background:
            with self._lock:
                pending, self._pending = self._pending, []
            for work, _ in pending:
                work.wait()
        if nbytes:  # what the link achieved: the message left when it was posted, one latency before its due time
            left = time.perf_counter() - latency_s
            with self._lock:
                r = self._rates.setdefault(peer, [0.0, 0.0, 0.0])
                r[0] += nbytes
                r[1] += max(left - max(handed, r[2]), 0.0)
                r[2] = left

    def link_rates(self) -> dict[int, tuple[float, float]]:
        """(bytes, seconds) each shaped link to a peer carried since the last call: a message's seconds run from
        when it was handed over (or the previous message on the link left, if later) to when it left; an unshaped
        link is absent (its sends are posted at once and complete out of sight: not measured)."""
        with self._lock:
            out = {peer: (r[0], r[1]) for peer, r in self._rates.items() if r[0]}
            for r in self._rates.values():
                r[0] = r[1] = 0.0
        return out

    def _route(self, tag: Tag) -> tuple[int, int]:
        check_tag(tag)
        return tag.peer(self.layout, self.me), tag.CHANNEL

    def send(self, tag: Tag, payload: Payload, axis: str | None, metered: int | None = None) -> None:
        """``metered``: the bytes to count on ``axis`` when part of the payload is protocol (a step
        number, say) rather than data the simulation counts; None = the whole payload."""
        peer, ch = self._route(tag)
        frame, body = self.auth.seal(peer, ch, encode_header(payload),
                                     [_as_bytes(to_host(t)) for t in payload.tensors.values()])
        parts = [frame] + body
        link = self.link_for(axis, peer)
        if link is None and not self.background:
            self._post(peer, ch, parts)
        else:
            if self._sender is None:
                self._sender = DueQueue(self._deliver)
            handed = link.clock() if link else time.perf_counter()
            due = link.delivery_time(payload.nbytes + self.overhead_bytes, handed) if link else handed
            rated = (payload.nbytes + self.overhead_bytes, handed, link.latency_ms / 1e3) if link and link.rate_mbps \
                else (0, 0.0, 0.0)
            self._sender.put(due, (peer, ch, parts, rated))
        if axis is not None:
            self.meter.add(axis, payload.nbytes if metered is None else metered)
        self.header_bytes += self.overhead_bytes

    def recv(self, tag: Tag, expect: Expect) -> Payload:
        """The payload of ``tag`` from its peer, if it proves the job key and is what ``expect`` allows."""
        peer, ch = self._route(tag)
        frame = torch.empty(FRAME_SLOTS, dtype=torch.int64)
        dist.recv(frame, peer, group=self.group, tag=ch)
        header, ticket = self.auth.open_header(peer, ch, frame)
        spec = decode_header(header)
        expect.check(spec, f"{type(tag).__name__} from rank {peer}")
        sizes = [_numel(shape) * torch.empty(0, dtype=dtype).element_size() for _, dtype, shape in spec]
        body = []
        for size in self.auth.body_bytes(sizes):
            raw = torch.empty(size, dtype=torch.uint8)
            dist.recv(raw, peer, group=self.group, tag=ch)
            body.append(raw)
        tensors = {}
        for (name, dtype, shape), raw in zip(spec, self.auth.open_body(peer, ch, ticket, body, sizes)):
            t = raw.view(dtype) if dtype != torch.bool else raw.to(torch.bool)
            tensors[name] = to_device(t.reshape(shape), self.device)
        return Payload(tensors)

    def idle(self) -> bool:
        """Nothing queued or in flight (meaningful with ``background``)."""
        return self._sender is None or self._sender.unfinished == 0

    def flush(self) -> None:
        """Wait for every send handed over so far to be posted and completed."""
        if self._sender is not None:
            self._sender.join()
            if self._sender.error is not None:
                raise RuntimeError(f"a shaped send failed: {self._sender.error}") from self._sender.error
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def close(self) -> None:
        """Stop the sender thread once what it holds is posted, so that no send is still in flight
        on it when the process group is destroyed."""
        if self._sender is not None:
            self._sender.close()


def job_wire(encrypt: bool, where: str) -> dict:
    """The ``key``/``encrypt`` arguments of this job's transports (``where`` names who needs the key)."""
    return {"key": job_key(where), "encrypt": encrypt}


def broadcast_payload(payload: Payload | None, src: int, group, device: torch.device | None = None,
                      expect: Expect | None = None) -> Payload:
    """``src``'s payload on every member of ``group``, as header + raw bytes (no pickle): the
    receivers check the header against ``expect`` and allocate only what it describes; every member
    gets it on ``device``. A collective: not authenticated by the job key (docs/security.md)."""
    me = dist.get_rank()
    sent: dict[str, torch.Tensor] = {}
    if me == src:
        assert payload is not None, "the source of a broadcast gives its payload (only the others pass None)"
        sent, header = payload.tensors, encode_header(payload)
    else:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    spec = decode_header(header)
    if me != src and expect is not None:
        expect.check(spec, f"a broadcast from rank {src}")
    tensors = {}
    for name, dtype, shape in spec:
        if me == src:
            raw = _as_bytes(to_host(sent[name])).clone()
        else:
            raw = torch.empty(_numel(shape) * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8)
        dist.broadcast(raw, src, group=group)
        t = raw.view(dtype) if dtype != torch.bool else raw.to(torch.bool)
        tensors[name] = to_device(t.reshape(shape), device)
    return Payload(tensors)
