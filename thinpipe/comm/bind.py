"""Where a job's listeners bind: only on the network the job lives on (docs/security.md).

Every socket a rank listens on (the rendezvous store, gloo's pairs, torchft's lighthouse and
managers, the recovery server) binds to one address, the job's:

- ``$THINPIPE_BIND_ADDR`` when set: the address of this machine on the job's network (a WireGuard
  or Tailscale address for a job across machines). ``0.0.0.0`` is accepted, since that is asking in
  so many words to listen on every interface;
- otherwise the loopback address when the job is on one machine (``$MASTER_ADDR`` unset or a
  loopback address: `thinpipe launch`'s jobs);
- otherwise nothing is guessed: a one-line error asks for ``$THINPIPE_BIND_ADDR``.

Gloo is told through ``$GLOO_SOCKET_IFNAME`` (the interface that holds the address; torch's gloo
takes no address), unless the user set that variable.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from thinpipe.config import ConfigError

BIND_ENV = "THINPIPE_BIND_ADDR"
LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"
_SIOCGIFADDR = 0x8915


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address() -> str:
    """The address this process's listeners bind to (see the module docstring)."""
    given = os.environ.get(BIND_ENV, "").strip()
    if given:
        try:
            ipaddress.IPv4Address(given)
        except ValueError:
            raise ConfigError(f"${BIND_ENV} = {given!r} is not an IPv4 address of this machine (e.g. its WireGuard "
                              f"address, or {LOOPBACK} for a job on one machine)") from None
        return given
    master = os.environ.get("MASTER_ADDR", LOOPBACK)
    if _is_loopback(master):
        return LOOPBACK
    raise ConfigError(f"$MASTER_ADDR is {master}, so the job spans machines: set ${BIND_ENV} to this machine's "
                      f"address on the job's network (a VPN such as WireGuard or Tailscale; {ANY} listens on every "
                      "interface) so that nothing listens where strangers can reach it (docs/security.md)")


def interface_of(addr: str) -> str:
    """The name of the interface that holds IPv4 ``addr`` (``lo`` for a loopback address)."""
    if _is_loopback(addr):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    raise ConfigError(f"no interface of this machine has the address {addr} (${BIND_ENV} / $MASTER_ADDR): give "
                      "this machine's own address on the job's network")


def point_gloo_at(addr: str) -> None:
    """Make gloo's sockets bind on ``addr``'s interface, unless the user chose one (``$GLOO_SOCKET_IFNAME``)."""
    if addr != ANY and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(addr)
