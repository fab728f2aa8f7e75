"""What a process of an elastic replica settles before it becomes a rank (docs/elastic.md): the config
it refuses, the environment the launcher and torchft set, its run folder and torchft identity, where
torchft's manager binds, and whether the lighthouse answers. ``engine/elastic_rank.py`` is the rank.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import urllib.parse
from pathlib import Path

import torchft.manager as torchft_manager

from thinpipe.comm.bind import ANY
from thinpipe.config import Config, ConfigError

REPLICA_ENV = "REPLICA_GROUP_ID"            # torchft's name for a replica's index
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"       # torchft's: the lighthouse's address
RESTART_ENV = "THINPIPE_ELASTIC_RESTART"    # the launcher's: how many times this replica was restarted
RESUME_ENV = "THINPIPE_ELASTIC_RESUME"      # the launcher's: "1" = continue from this replica's folder


def check_elastic(cfg: Config) -> None:
    if cfg.mesh.split == "auto":
        raise ConfigError("mesh.split = auto is agreed by the ranks of one world, and each elastic replica is its own "
                          "world (replicas could choose apart): give the split as a list (e.g. the one an --engine "
                          "dist run's config.toml holds)")
    if cfg.mesh.anchor:
        raise ConfigError("elastic replicas do not run an anchor circuit yet: set mesh.anchor = 0, "
                          "or use --engine dist")
    if cfg.train.on_divergence == "rollback":
        raise ConfigError("elastic replicas cannot roll back a divergence yet (each replica would go back alone): "
                          "set train.on_divergence = stop")
    if cfg.diag.every:
        raise ConfigError("elastic replicas do not compute gradient diagnostics: set diag.every = 0")


def quiet_torchft() -> None:
    """torchft's Python side warns about NCCL on CPU ranks and logs every reconfiguration;
    thinpipe reports membership itself (events.jsonl). Errors still show. (Its Rust side is quieted
    by RUST_LOG=warn, which the CLI sets before torchft is imported.)"""
    logging.getLogger("torchft").setLevel(logging.ERROR)


def replica_folder(out: Path, replica: int, restart: int) -> Path:
    """The run folder of one replica's processes: each restart writes a new one (nothing is overwritten)."""
    return out / (f"replica{replica}" if restart == 0 else f"replica{replica}-restart{restart}")


def replica_id(replica: int) -> str:
    # fixed width: torchft orders a quorum's members by id, so replica r is r-th, as in --engine dist
    return f"thinpipe_replica_{replica:04d}"


def advertised(addr: str) -> str:
    """The address peers reach a listener bound on ``addr`` at (the host's name when it listens everywhere)."""
    return socket.gethostname() if addr == ANY else addr


@contextlib.contextmanager
def manager_binds_to(addr: str):
    """torchft 0.2.0's ``Manager`` starts its ``ManagerServer`` (the replica's quorum/commit RPC server)
    on ``f"[::]:{port}"`` (torchft/manager.py, ``bind = ...``): no argument or environment variable
    chooses the address (``$TORCHFT_MANAGER_PORT`` only the port). While a Manager is built here, the
    name torchft.manager calls is a wrapper that keeps the port and binds ``addr``."""
    original = torchft_manager.ManagerServer

    def bound(*args, bind: str, **kwargs):
        return original(*args, bind=f"{addr}:{bind.rpartition(':')[2]}", **kwargs)

    torchft_manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original


def check_lighthouse(address: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, in one line, when the lighthouse cannot be reached (torchft would wait a minute
    and raise from deep inside its manager)."""
    url = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(f"${LIGHTHOUSE_ENV} = {address}: no torchft lighthouse answers there ({e}); start one "
                          "(torchft_lighthouse --bind ADDR:29510 --min_replicas 1, ADDR on the job's network, "
                          "docs/elastic.md) or fix the address") from None
