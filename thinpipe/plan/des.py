"""Schedule-level discrete-event simulation of one replica's pipeline step.

Refines App. J.1's closed form where it is blind: each boundary has its own link per direction
(bandwidth + latency, FIFO), stages compute one action at a time in their schedule's order (GPipe
or 1F1B, ``rank/schedule.py``: the schedules the engines run), and a stage waits for its input.
So pipelining across boundaries, the fill/drain bubble and per-message latency all show up.

Times in seconds, sizes in bytes, rates in bytes/s. An action F(s, m) starts when stage s is free
and microbatch m's activation has arrived from stage s-1; B(s, m) when stage s is free and the
gradient has arrived from stage s+1 (and F(s, m) is done). A message enters its link when the
action that produced it ends, waits for the link to be free, holds it for bytes / rate and
arrives ``latency_s`` later. With ``burst_bytes`` the link is a token bucket of that depth (as a
kernel shaper is, ``comm/netns.py``): tokens refill at the rate while the link idles, and a message
pays bytes / rate only for what the bucket does not cover.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.rank.schedule import SCHEDULES, serial_order


@dataclass(frozen=True)
class PipelineStep:
    stages: int
    microbatches: int
    t_forward_s: float            # one microbatch's forward on one stage
    t_backward_s: float           # its backward
    fwd_bytes: float              # one microbatch's message across one boundary, forward
    bwd_bytes: float              # and backward
    rate_bytes_per_s: float       # every PP link's bandwidth (each direction of each boundary)
    latency_s: float = 0.0
    schedule: str = "1f1b"
    burst_bytes: float = 0.0      # token-bucket depth of every link (0 = a pure rate)
    # per boundary (issue 54: uneven links and a codec per boundary); empty: the single values above everywhere
    rates: tuple[float, ...] = ()           # each boundary's bandwidth, bytes/s
    fwd_bytes_per: tuple[float, ...] = ()   # each boundary's forward message
    bwd_bytes_per: tuple[float, ...] = ()   # and backward
    latencies_s: tuple[float, ...] = ()


def simulate(p: PipelineStep) -> dict:
    """Makespan of one step and the busy fraction of the stages (1 - bubble)."""
    if p.rate_bytes_per_s <= 0 or any(r <= 0 for r in p.rates):
        raise ValueError(f"link rate must be > 0 bytes/s, got {p.rates or p.rate_bytes_per_s}")

    def at(per: tuple[float, ...], one: float, b: int) -> float:
        return per[b] if per else one

    rows = SCHEDULES[p.schedule](p.stages, p.microbatches)
    free = [0.0] * p.stages                     # when each stage is next idle
    link_free: dict[tuple[int, str], float] = {}  # (boundary, direction) -> when the link is next idle
    tokens: dict[tuple[int, str], float] = {}     # bytes in the link's bucket when it went idle
    arrive: dict[tuple[int, str, int], float] = {}  # (receiving stage, kind, mb) -> arrival time
    done: dict[tuple[int, str, int], float] = {}
    busy = 0.0
    for s, (kind, m) in serial_order(rows):
        ready = free[s]
        if kind == "F" and s > 0:
            ready = max(ready, arrive[(s, "F", m)])
        if kind == "B":
            ready = max(ready, done[(s, "F", m)])
            if s < p.stages - 1:
                ready = max(ready, arrive[(s, "B", m)])
        dur = p.t_forward_s if kind == "F" else p.t_backward_s
        end = ready + dur
        busy += dur
        free[s] = done[(s, kind, m)] = end
        # the message this action produces
        if kind == "F" and s < p.stages - 1:
            key, nbytes, to = (s, "fwd"), at(p.fwd_bytes_per, p.fwd_bytes, s), s + 1
        elif kind == "B" and s > 0:
            key, nbytes, to = (s - 1, "bwd"), at(p.bwd_bytes_per, p.bwd_bytes, s - 1), s - 1
        else:
            continue
        rate = at(p.rates, p.rate_bytes_per_s, key[0])
        start = max(end, link_free.get(key, 0.0))
        idle_s = start - link_free.get(key, 0.0)
        bucket = min(p.burst_bytes, tokens.get(key, p.burst_bytes) + idle_s * rate)
        tokens[key] = max(bucket - nbytes, 0.0)
        link_free[key] = start + max(nbytes - bucket, 0.0) / rate
        arrive[(to, kind, m)] = link_free[key] + at(p.latencies_s, p.latency_s, key[0])
    makespan = max(free)
    return {"makespan_s": makespan, "busy_fraction": busy / (p.stages * makespan) if makespan > 0 else 1.0}
