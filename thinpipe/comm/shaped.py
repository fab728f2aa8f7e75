"""Link shaping in user space: bandwidth (token bucket) and latency per link, no root needed.

A message of n bytes handed to a link at time t leaves it no earlier than
    start = max(t, link free)      done = start + n * 8 / rate      arrival = done + latency
so back-to-back messages queue behind each other at the link's rate, and each arrives one latency
after it was fully sent. ``ShapedLink.wait(n)`` sleeps the sender until the message may be
delivered (the sender blocks, as a real socket buffer would once full); rate 0 = unshaped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ShapedLink:
    rate_mbps: float = 0.0
    latency_ms: float = 0.0
    _free_at: float = field(default=0.0, repr=False)
    clock: callable = field(default=time.perf_counter, repr=False)
    sleep: callable = field(default=time.sleep, repr=False)

    def __post_init__(self) -> None:
        if self.rate_mbps < 0 or self.latency_ms < 0:
            raise ValueError(f"a link needs rate_mbps >= 0 and latency_ms >= 0, got {self.rate_mbps}, {self.latency_ms}")

    def delivery_time(self, nbytes: int, now: float) -> float:
        """When a message of ``nbytes`` handed over at ``now`` arrives (and book the link)."""
        start = max(now, self._free_at)
        done = start + (nbytes * 8 / (self.rate_mbps * 1e6) if self.rate_mbps else 0.0)
        self._free_at = done
        return done + self.latency_ms / 1e3

    def wait(self, nbytes: int) -> float:
        """Sleep until the message may be delivered; returns the seconds slept."""
        now = self.clock()
        delay = self.delivery_time(nbytes, now) - now
        if delay > 0:
            self.sleep(delay)
        return max(delay, 0.0)
