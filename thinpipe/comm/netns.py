"""Real links on one Linux machine: every rank in its own network namespace, bandwidth shaped by
the kernel (docs/distributed.md: real links on one machine; anchor-priors App. H.1 sizes PP/DP links
in Mbit/s).

Layout: a hub namespace holds a bridge; rank i's namespace holds ``eth0`` (10.77.0.<i+1>/24),
one end of a veth pair whose other end is a bridge port. On each rank's egress an HTB qdisc gives
every peer its own class: a PP link (stages s, s+1 of one row; first and last stage when the tied
embedding is synchronised) at ``link.pp_mbps``, a link between rows (DP, anchor pull/push) at
``link.dp_mbps``; 0 leaves the link unshaped. Latency is not added here (this kernel has no netem):
the transport adds it in user space as in the default mode. Needs root and ``ip``/``tc``; every
namespace this creates is deleted again by ``delete`` (the launcher calls it in a ``finally``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from thinpipe.config import ConfigError
from thinpipe.layout import MeshLayout

SUBNET = "10.77.0"
UNSHAPED_MBIT = 100_000  # the default class: control traffic between ranks with no shaped link
# Bucket depth of every shaped class (tc's own default at these rates is about the same, but set
# here so that a model can know it): after an idle spell this many bytes leave at line rate, so a
# message of a few KB crosses faster than bytes / rate (``plan/des.py`` models it: ``burst_bytes``).
KERNEL_BURST_BYTES = 1600


@dataclass
class Namespaces:
    hub: str
    ranks: list[str]

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"


def link_rates_mbps(layout: MeshLayout, pp_mbps: float | list[float], dp_mbps: float,
                    tied: bool) -> dict[tuple[int, int], float]:
    """Egress rate of every ordered rank pair that has a shaped link (rank i -> rank j); ``pp_mbps``: one rate, or
    one per boundary (the tied embedding's link between the first and last stage takes the slowest)."""
    rates = {}
    per = pp_mbps if isinstance(pp_mbps, list) else [pp_mbps] * max(layout.pp - 1, 0)
    for row in range(layout.rows):
        ranks = layout.grid[row]
        pairs = [(ranks[s], ranks[s + 1], per[s]) for s in range(layout.pp - 1)]
        if tied and layout.pp > 2:
            pairs.append((ranks[0], ranks[-1], min(per)))
        for a, b, mbps in pairs:
            if mbps:
                rates[(a, b)] = rates[(b, a)] = mbps
    for s in range(layout.pp):
        col = [layout.grid[r][s] for r in range(layout.rows)]
        for a in col:
            for b in col:
                if a != b and dp_mbps:
                    rates[(a, b)] = dp_mbps
    return rates


def check_available() -> None:
    if os.name != "posix" or os.geteuid() != 0:
        raise ConfigError("--netns needs root (it creates network namespaces and tc qdiscs); run as root, or "
                          "drop --netns to shape links in the transport instead")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(f"--netns needs the `{tool}` command (Debian: apt-get install iproute2)")


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def create(layout: MeshLayout, rates: dict[tuple[int, int], float], job: str) -> Namespaces:
    """Build the namespaces, bridge, addresses and qdiscs; on any failure remove what was built."""
    check_available()
    ns = Namespaces(hub=f"tp{job}hub", ranks=[f"tp{job}r{i}" for i in range(layout.world_size)])
    try:
        _run("ip", "netns", "add", ns.hub)
        _run("ip", "-n", ns.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ns.hub, "link", "set", "br0", "up")
        for i, name in enumerate(ns.ranks):
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", ns.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "-n", ns.hub, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", ns.hub, "link", "set", f"p{i}", "up")
            _run("ip", "-n", name, "addr", "add", f"{ns.addr(i)}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _shape(name, i, rates, ns)
    except BaseException:
        delete(ns)
        raise
    return ns


def _shape(name: str, me: int, rates: dict[tuple[int, int], float], ns: Namespaces) -> None:
    mine = {j: r for (i, j), r in rates.items() if i == me}
    if not mine:
        return
    tc = ("ip", "netns", "exec", name, "tc")
    _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
    _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", f"{UNSHAPED_MBIT}mbit")
    for j, mbps in sorted(mine.items()):
        cls = f"1:{10 + j}"
        _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
             "rate", f"{mbps}mbit", "ceil", f"{mbps}mbit",
             "burst", f"{KERNEL_BURST_BYTES}b", "cburst", f"{KERNEL_BURST_BYTES}b")
        _run(*tc, "filter", "add", "dev", "eth0", "protocol", "ip", "parent", "1:", "prio", "1", "u32",
             "match", "ip", "dst", f"{ns.addr(j)}/32", "flowid", cls)


def delete(ns: Namespaces) -> None:
    """Remove every namespace of the job (their veths and qdiscs go with them); never raises."""
    for name in [*ns.ranks, ns.hub]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
