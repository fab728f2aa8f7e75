"""``thinpipe launch``: a distributed training job as local processes.

Default: torchrun (``--standalone``) starts the N ranks. With ``--netns`` (Linux, root) this
module is the launcher: it builds one network namespace per rank with kernel-shaped links
(``comm/netns.py``), starts each rank inside its namespace (env:// rendezvous on rank 0's address),
watches them as torchrun would (the first rank that fails stops the others and is named, with its
role), and deletes the namespaces whatever happens (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from thinpipe.config import ConfigError, load_config
from thinpipe.engine.log import say
from thinpipe.mesh import MeshLayout

MASTER_PORT = 29500  # inside the job's own namespaces: no other job can hold it


def train_args(rest: list[str]) -> list[str]:
    rest = [a for a in rest if a != "--"]
    if not rest or rest[0] != "train":
        raise ConfigError("thinpipe launch runs a training job: thinpipe launch --nproc N -- train --out DIR ...")
    return rest


def launch_torchrun(nproc: int, rest: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "thinpipe", *train_args(rest), "--engine", "dist"]
    return subprocess.call(cmd)


def launch_netns(nproc: int, rest: list[str]) -> int:
    from thinpipe.comm import netns

    args = train_args(rest)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    known, _ = p.parse_known_args(args[1:])
    cfg = load_config(known.config, known.set)
    layout = MeshLayout(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.anchor)
    layout.check_world(nproc)  # before building anything
    netns.check_available()
    tied = cfg.model.tied == "sync"
    rates = netns.link_rates_mbps(layout, cfg.link.pp_mbps, cfg.link.dp_mbps, tied)
    ns = netns.create(layout, rates, job=str(os.getpid() % 100000))
    procs: list[subprocess.Popen] = []
    try:
        for i, name in enumerate(ns.ranks):
            env = {**os.environ, "RANK": str(i), "WORLD_SIZE": str(nproc), "LOCAL_RANK": "0",
                   "MASTER_ADDR": ns.addr(0), "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": "eth0",
                   "THINPIPE_WATCH_PARENT": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "thinpipe", *args, "--engine", "dist",
                   "--set", "link.shaper=kernel"]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        say(f"[thinpipe launch] {nproc} ranks in network namespaces {ns.ranks[0]}..{ns.ranks[-1]} "
            f"({len(rates)} shaped links)")
        return _supervise(procs, layout)
    except KeyboardInterrupt:
        say("[thinpipe launch] interrupted: stopping every rank")
        _stop(procs)
        raise
    finally:
        _stop(procs)
        netns.delete(ns)


def _supervise(procs: list[subprocess.Popen], layout: MeshLayout) -> int:
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                role = layout.role(rank)
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                say(f"[thinpipe launch] Root Cause: rank {rank} ({role.circuit} replica {role.replica}, stage "
                    f"{role.stage}) failed with {how}; stopping the other ranks")
                _stop(procs)
                return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
