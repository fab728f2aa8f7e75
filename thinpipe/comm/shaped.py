"""Link shaping in user space: bandwidth (a pure rate, no burst) and latency per link, no root needed.

A message of n bytes handed to a link at time t leaves it no earlier than
    start = max(t, link free)      done = start + n * 8 / rate      arrival = done + latency
so back-to-back messages queue behind each other at the link's rate, and each arrives one latency
after it was fully sent; rate 0 = unshaped. ``DueQueue`` holds each message until that arrival time
on a background thread (the caller computes on meanwhile, as with a real NIC) and delivers them in
arrival order, so messages overlap their latencies as on a real network.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from thinpipe.config.mesh import LinkConfig
from thinpipe.console import say


@dataclass
class ShapedLink:
    rate_mbps: float = 0.0
    latency_ms: float = 0.0
    _free_at: float = field(default=0.0, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def __post_init__(self) -> None:
        if self.rate_mbps < 0 or self.latency_ms < 0:
            raise ValueError(f"a link needs rate_mbps >= 0 and latency_ms >= 0, got {self.rate_mbps}, "
                             f"{self.latency_ms}")

    def delivery_time(self, nbytes: int, now: float) -> float:
        """When a message of ``nbytes`` handed over at ``now`` arrives (and book the link)."""
        start = max(now, self._free_at)
        done = start + (nbytes * 8 / (self.rate_mbps * 1e6) if self.rate_mbps else 0.0)
        self._free_at = done
        return done + self.latency_ms / 1e3


Item = TypeVar("Item")


class DueQueue(Generic[Item]):
    """One background thread that hands each queued item to ``deliver`` at its due time (the
    ``delivery_time`` of its link, taken when the caller handed the message over), earliest first,
    ties in hand-over order.

    Why due times and not a FIFO that sleeps per message: on a real link several messages are in
    flight at once, so a second message handed over during the first's latency arrives one transfer
    time after it, not one transfer + one latency; and a message to one peer never waits behind a
    slower link to another. Per link due times never decrease (``_free_at`` only grows, the latency
    is fixed), so each link's messages keep their order.
    """

    def __init__(self, deliver: Callable[[Item], None], clock: Callable[[], float] = time.perf_counter,
                 name: str = "thinpipe-link"):
        self._deliver, self._clock = deliver, clock
        self._heap: list[tuple[float, int, Item]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._unfinished = 0
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def put(self, due_s: float, item: Item) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("a message was handed to a closed link")
            heapq.heappush(self._heap, (due_s, next(self._seq), item))
            self._unfinished += 1
            self._cv.notify_all()

    @property
    def unfinished(self) -> int:
        """Items queued or being delivered."""
        return self._unfinished

    def join(self) -> None:
        """Block until every item handed over so far has been delivered."""
        with self._cv:
            while self._unfinished:
                self._cv.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued, then stop the thread (so that nothing is in flight on it when the
        process group is torn down)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            say(f"[thinpipe] warning: {self._unfinished} message(s) still queued on a shaped link after "
                f"{timeout_s:.0f} s at shutdown; they may be lost")

    _STOP = object()

    def _next(self) -> object:
        with self._cv:
            while True:
                if not self._heap:
                    if self._closed:
                        return self._STOP
                    self._cv.wait()
                    continue
                delay = self._heap[0][0] - self._clock()
                if delay <= 0:
                    return heapq.heappop(self._heap)[2]
                self._cv.wait(timeout=delay)  # an earlier-due item may arrive meanwhile

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is self._STOP:
                return
            try:
                self._deliver(cast(Item, item))  # not the stop sentinel: a queued item
            except BaseException as e:  # surfaced by the owner (``DistTransport.flush``)
                self.error = e
            finally:
                with self._cv:
                    self._unfinished -= 1
                    self._cv.notify_all()


PP_AXES = ("pp_fwd", "pp_bwd", "pp_params", "tied", "rollout")


class MeshLinks:
    """A rank's outgoing links: one per peer on the PP axes (shared by everything it sends that peer), one per peer on
    the anchor's pull and push links (they cross between rows: shaped like DP links). A PP link takes its boundary's
    rate and latency (``link.pp_mbps`` may list one per boundary; a link between stages that are not neighbours, the
    tied embedding's between the first and last stage, takes the slowest boundary's). With kernel shaping
    (``thinpipe launch --netns``) tc enforces the rates; only the latency stays."""

    def __init__(self, lk: LinkConfig, stage_of: Callable[[int], int] | None = None, me: int = 0) -> None:
        """``lk``: the config's ``link`` section; ``stage_of(rank)``: a rank's stage (the boundary of a PP link),
        ``me`` this rank."""
        self.lk, self.kernel = lk, lk.shaper == "kernel"
        self.dp_mbps = 0.0 if self.kernel else lk.dp_mbps
        self.dp_latency_ms = lk.dp_latency_ms
        self.stage_of, self.me = stage_of, me
        self._pp: dict[int, ShapedLink | None] = {}
        self._anchor: dict[int, ShapedLink] = {}

    def boundary(self, peer: int) -> int | None:
        """The boundary a PP link to ``peer`` crosses (None: not neighbouring stages, or no layout given)."""
        if self.stage_of is None:
            return None
        a, b = self.stage_of(self.me), self.stage_of(peer)
        return min(a, b) if abs(a - b) == 1 else None

    def pp_rate(self, peer: int) -> tuple[float, float]:
        """(Mbit/s, latency ms) of the PP link to ``peer``."""
        lk, b = self.lk, self.boundary(peer)
        mbps = lk.pp_mbps_at(b) if b is not None else lk.pp_mbps_min
        latency = lk.pp_latency_ms_at(b) if b is not None else (
            max(lk.pp_latency_ms) if isinstance(lk.pp_latency_ms, list) else lk.pp_latency_ms)
        return (0.0 if self.kernel else mbps), latency

    def pp(self, axis: str | None, peer: int) -> ShapedLink | None:
        if axis not in PP_AXES:
            return None
        if peer not in self._pp:
            mbps, latency = self.pp_rate(peer)
            self._pp[peer] = ShapedLink(mbps, latency) if (mbps or latency) else None
        return self._pp[peer]

    def anchor(self, axis: str | None, peer: int) -> ShapedLink | None:
        if self.dp_mbps or self.dp_latency_ms:
            return self._anchor.setdefault(peer, ShapedLink(self.dp_mbps, self.dp_latency_ms))
        return None
