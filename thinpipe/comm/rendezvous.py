"""torch.distributed's start-up with every listener bound where the job lives (``comm/bind.py``).

``init_process_group("gloo")`` with ``env://`` makes rank 0's rendezvous store (a ``TCPStore``)
listen on every interface, whatever ``$MASTER_ADDR`` says, and gloo's pairs bind wherever the host
name resolves. Here rank 0 binds the store's socket itself, on the job's address, and hands it over
(``TCPStore(..., master_listen_fd=...)``), and gloo is pointed at the job's interface. Under torchrun
the agent holds the store (``$TORCHELASTIC_USE_AGENT_STORE``): that listener is torchrun's, bound
by its ``--rdzv-endpoint``/``--master-addr`` (docs/security.md), and only gloo is pointed.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from thinpipe.comm.bind import LOOPBACK, bind_address, point_gloo_at
from thinpipe.config import ConfigError

_LISTENERS: list[socket.socket] = []  # the store's socket lives as long as the process's store


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} = {value!r} is not an integer (torchrun or `thinpipe launch` sets it)") from None


def init_gloo(timeout_s: float) -> None:
    """Join this process's torch.distributed world (gloo), listening only on the job's address."""
    addr = bind_address()
    point_gloo_at(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        dist.init_process_group("gloo", timeout=timeout)
        return
    rank, world, port = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("MASTER_PORT")
    host = os.environ.get("MASTER_ADDR", LOOPBACK)
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"rank 0 cannot listen on {addr}:{port} for the rendezvous ({e.strerror}): "
                              "choose a free $MASTER_PORT") from None
        sock.listen(128)
        _LISTENERS.append(sock)
        store = dist.TCPStore(host, port, world, is_master=True, timeout=timeout, master_listen_fd=sock.fileno(),
                              wait_for_workers=False)
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
