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
import subprocess
import sys
import threading
import time
from pathlib import Path

from thinpipe.comm import netns as nets
from thinpipe.comm.bind import BIND_ENV, LOOPBACK
from thinpipe.comm.orphan import WATCH_ENV
from thinpipe.commands import train
from thinpipe.commands.common import build_parser
from thinpipe.commands.launching import INTERRUPTED, failures, free_port, how, job_key_env, stop, train_args
from thinpipe.commands.rank_starter import START_METHODS, RankProcess, RankStarter
from thinpipe.config import ConfigError, load_config
from thinpipe.config.errors import rank_errors
from thinpipe.console import say
from thinpipe.layout import MeshLayout
from thinpipe.runlock import RunLock, take_run_lock

NAME = "launch"
HELP = "run a dist training job as N local processes"
NETNS_PORT = 29500  # inside the job's own namespaces: no other job can hold it


def add_arguments(la: argparse.ArgumentParser) -> None:
    la.add_argument("--nproc", type=int, help="processes = (mesh.dp + mesh.anchor) x mesh.pp (with --elastic: "
                                              "optional, mesh.dp x mesh.pp)")
    la.add_argument("--elastic", action="store_true", help="replicas that may fail and come back (torchft): a "
                    "lighthouse, one torch.distributed world per replica, dead replicas restarted (docs/elastic.md)")
    la.add_argument("--max-restarts", type=int, default=3, help="with --elastic: restarts per replica (default 3)")
    la.add_argument("--netns", action="store_true",
                    help="each rank in its own network namespace, link.pp_mbps / link.dp_mbps enforced by the "
                         "kernel (tc); Linux, root")
    la.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                    help="forkserver (default): each rank forked from one process that has imported torch and the "
                         "engine; spawn: each a fresh python (as torchrun's --start-method)")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="-- train --out DIR --set ...")


def run(args) -> int:
    """N local processes of `thinpipe train --engine dist` (``launch``), optionally each in its own network
    namespace (``--netns``, kernel-shaped links); with ``--elastic`` the replicas of ``launch_elastic.py``."""
    rest = [a for a in args.rest if a != "--"]
    if rest[:1] == ["train"]:  # the ranks' arguments, checked once here: argparse's line once, not once per rank
        try:
            build_parser([train]).parse_args(rest)
        except SystemExit as e:
            return int(e.code or 0)
    if args.elastic:
        os.environ.setdefault("RUST_LOG", "warn")  # as in train.py, before torchft is imported
        from thinpipe.commands.launch_elastic import launch_elastic  # torchft: an optional dependency

        if args.netns:
            raise ConfigError("--elastic does not run in network namespaces yet: drop --netns (or --elastic)")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        return launch_elastic(args.rest, args.max_restarts, nproc=args.nproc, start_method=args.start_method)
    if args.nproc is None:
        raise ConfigError("thinpipe launch needs --nproc N (N = (mesh.dp + mesh.anchor) x mesh.pp)")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    return launch(args.nproc, args.rest, netns=args.netns, start_method=args.start_method)


def launch(nproc: int, rest: list[str], netns: bool = False, start_method: str = "forkserver") -> int:
    args = train_args(rest)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--recipe")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true")
    known, _ = p.parse_known_args(args[1:])
    cfg = load_config(known.config, known.set, recipe=known.recipe)
    layout = MeshLayout(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.anchor)
    layout.check_world(nproc)  # before starting (or building) anything
    # the job's folder lock (runlock.py), held here for the ranks: they inherit its name and are not refused
    lock = take_run_lock(Path(known.out), job=True, create=not known.resume) if known.out else RunLock()
    ns = None
    if netns:
        nets.check_available()
        rates = nets.link_rates_mbps(layout, cfg.link.pp_mbps, cfg.link.dp_mbps, cfg.model.tied == "sync")
        ns = nets.create(layout, rates, job=str(os.getpid() % 100000))
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    starter = None if ns else RankStarter(["thinpipe.engine.dist_engine", "thinpipe.cli"], threads, start_method)
    procs: list[subprocess.Popen | RankProcess] = []
    # Ctrl-C sets a flag the supervision loop reads, rather than raising KeyboardInterrupt at an
    # arbitrary point: one raised inside Popen.poll() can leave its wait lock held, and the
    # cleanup's wait() would then hang forever.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    keys = contextlib.ExitStack()  # the job key's folder goes when the ranks have stopped
    try:
        key_env = keys.enter_context(job_key_env())
        error_env, rank_errors_found = keys.enter_context(rank_errors())  # the ranks' error lines (config/errors.py)
        port = NETNS_PORT if ns else free_port()
        for i in range(nproc):
            env = {**os.environ, **key_env, **error_env, "RANK": str(i), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(i),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": ns.addr(0) if ns else LOOPBACK,
                   "MASTER_PORT": str(port), WATCH_ENV: str(os.getpid()), BIND_ENV: ns.addr(i) if ns else LOOPBACK,
                   "OMP_NUM_THREADS": threads}
            if ns is None:  # by default forked from a server that has imported torch and the engine (rank_starter.py)
                assert starter is not None
                role = layout.role(i)
                procs.append(starter.start([*args, "--engine", "dist"], env, f"thinpipe rank {i} ({role.circuit} "
                                           f"replica {role.replica}, stage {role.stage})"))
                continue
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            cmd = ["ip", "netns", "exec", ns.ranks[i], sys.executable, "-m", "thinpipe", *args, "--engine", "dist",
                   "--set", "link.shaper=kernel"]
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
        stop(procs)
        keys.close()
        lock.release()
        if ns:
            nets.delete(ns)
        signal.signal(signal.SIGINT, previous)


def _supervise(procs: list[subprocess.Popen | RankProcess], layout: MeshLayout, interrupted: threading.Event) -> int:
    anchor_gone: set[int] = set()
    while True:
        if interrupted.is_set():
            return INTERRUPTED
        codes = [p.poll() for p in procs]
        for rank, code in failures(codes):
            if rank in anchor_gone:
                continue
            role = layout.role(rank)
            if role.circuit == "anchor":
                anchor_gone.add(rank)
                say(f"[thinpipe launch] warning: anchor rank {rank} (stage {role.stage}) died with {how(code)}; "
                    "the fast circuit goes on without anchor priors")
                continue
            if code != 2:  # 2: a bad input, which the rank reported (its line is the cause)
                say(f"[thinpipe launch] Root Cause: rank {rank} ({role.circuit} replica {role.replica}, stage "
                    f"{role.stage}) failed with {how(code)}; stopping the other ranks")
            stop(procs)
            return 1
        if all(c == 0 for r, c in enumerate(codes) if layout.role(r).circuit == "fast"):
            # The anchor ranks end once the fast ranks have stopped them; a straggler is stopped.
            stop(procs, grace_s=30.0, terminate=False)
            return 0
        time.sleep(0.2)
