"""``thinpipe launch``: a distributed training job as local processes.

thinpipe's own launcher (one machine; torchrun's rendezvous is the way across machines, see
docs/distributed.md): it starts the N ranks with an env:// rendezvous, each printing its role, and
watches them. A fast rank that fails stops the job: the others are stopped and the failed rank is
named with its role (the "Root Cause"). An anchor rank that dies does not: the fast circuit needs
no anchor to go on (it warns and trains without priors), so the launcher says so and waits for the
fast ranks. With ``--netns`` (Linux, root) each rank runs in its own network namespace with
kernel-shaped links (``comm/netns.py``); the namespaces are deleted whatever happens (Ctrl-C too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from thinpipe.comm import netns as nets
from thinpipe.comm.bind import BIND_ENV, LOOPBACK
from thinpipe.comm.jobkey import KEY_ENV, write_key_file
from thinpipe.config import ConfigError, load_config
from thinpipe.config.errors import rank_errors
from thinpipe.log import say
from thinpipe.mesh import MeshLayout
from thinpipe.runlock import RunLock, take_run_lock

NETNS_PORT = 29500  # inside the job's own namespaces: no other job can hold it


def train_args(rest: list[str]) -> list[str]:
    rest = [a for a in rest if a != "--"]
    if not rest or rest[0] != "train":
        raise ConfigError("thinpipe launch runs a training job: thinpipe launch --nproc N -- train --out DIR ...")
    return rest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def job_key_env():
    """The environment that gives a job's ranks their job key: the user's (``$THINPIPE_JOB_KEY_FILE``)
    or a new one, in a private folder (mode 0700) that is removed with the job (docs/security.md)."""
    if os.environ.get(KEY_ENV):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="thinpipe-job-") as folder:
        yield {KEY_ENV: str(write_key_file(Path(folder) / "job.key"))}


def launch(nproc: int, rest: list[str], netns: bool = False) -> int:
    args = train_args(rest)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true")
    known, _ = p.parse_known_args(args[1:])
    cfg = load_config(known.config, known.set)
    layout = MeshLayout(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.anchor)
    layout.check_world(nproc)  # before starting (or building) anything
    # the job's folder lock (runlock.py), held here for the ranks: they inherit its name and are not refused
    lock = take_run_lock(Path(known.out), job=True, create=not known.resume) if known.out else RunLock()
    ns = None
    if netns:
        nets.check_available()
        rates = nets.link_rates_mbps(layout, cfg.link.pp_mbps, cfg.link.dp_mbps, cfg.model.tied == "sync")
        ns = nets.create(layout, rates, job=str(os.getpid() % 100000))
    procs: list[subprocess.Popen] = []
    # Ctrl-C sets a flag the supervision loop reads, rather than raising KeyboardInterrupt at an
    # arbitrary point: one raised inside Popen.poll() can leave its wait lock held, and the
    # cleanup's wait() would then hang forever.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    keys = contextlib.ExitStack()  # the job key's folder goes when the ranks have stopped
    try:
        key_env = keys.enter_context(job_key_env())
        error_env, rank_errors_found = keys.enter_context(rank_errors())  # the ranks' error lines (config/errors.py)
        port = NETNS_PORT if ns else _free_port()
        for i in range(nproc):
            env = {**os.environ, **key_env, **error_env, "RANK": str(i), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(i),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": ns.addr(0) if ns else LOOPBACK,
                   "MASTER_PORT": str(port), "THINPIPE_WATCH_PARENT": "1", BIND_ENV: ns.addr(i) if ns else LOOPBACK,
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            cmd = [sys.executable, "-m", "thinpipe", *args, "--engine", "dist"]
            if ns:
                env["GLOO_SOCKET_IFNAME"] = "eth0"
                cmd = ["ip", "netns", "exec", ns.ranks[i], *cmd, "--set", "link.shaper=kernel"]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        if ns:
            say(f"[thinpipe launch] {nproc} ranks in network namespaces {ns.ranks[0]}..{ns.ranks[-1]} "
                f"({len(rates)} shaped links)")
        code = _supervise(procs, layout, interrupted)
        if code and (found := rank_errors_found()):  # a bad input the ranks found: each distinct line once
            for line in found[1:]:
                say(f"error: {line}")
            raise ConfigError(found[0])
        if code == INTERRUPTED:
            say("[thinpipe launch] interrupted: stopping every rank")
        return code
    finally:
        _stop(procs)
        keys.close()
        lock.release()
        if ns:
            nets.delete(ns)
        signal.signal(signal.SIGINT, previous)


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


INTERRUPTED = 130  # the shell's exit status for a job stopped by SIGINT


def _supervise(procs: list[subprocess.Popen], layout: MeshLayout, interrupted: threading.Event) -> int:
    anchor_gone: set[int] = set()
    while True:
        if interrupted.is_set():
            return INTERRUPTED
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code in (None, 0) or rank in anchor_gone:
                continue
            role = layout.role(rank)
            if role.circuit == "anchor":
                anchor_gone.add(rank)
                say(f"[thinpipe launch] warning: anchor rank {rank} (stage {role.stage}) died with {_how(code)}; "
                    "the fast circuit goes on without anchor priors")
                continue
            if code != 2:  # 2: a bad input, which the rank reported (its line is the cause)
                say(f"[thinpipe launch] Root Cause: rank {rank} ({role.circuit} replica {role.replica}, stage "
                    f"{role.stage}) failed with {_how(code)}; stopping the other ranks")
            _stop(procs)
            return 1
        if all(c == 0 for r, c in enumerate(codes) if layout.role(r).circuit == "fast"):
            # The anchor ranks end once the fast ranks have stopped them; a straggler is stopped.
            _stop(procs, grace_s=30.0, terminate=False)
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0, terminate: bool = True) -> None:
    """SIGTERM (unless ``terminate`` is False), up to ``grace_s`` for them to exit, then SIGKILL."""
    for p in procs:
        if terminate and p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
