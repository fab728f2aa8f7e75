"""Rank processes forked from a warm server, so that a job's N ranks import torch, transformers and the engine once.

A rank started as ``python -m thinpipe train --engine dist`` spends ~5 s of CPU importing torch, transformers and
thinpipe's engine before it does anything; N ranks on one machine pay it N times, at once, on the same cores
(docs/testing.md: most of a small job's time). ``thinpipe launch`` instead starts one server process that imports
them once (multiprocessing's ``forkserver``, the start method torchrun's ``--start-method forkserver`` uses for
the same reason) and forks each rank from it. A rank is still its own process, in its own session, with its own
environment (its ``RANK``, ``MASTER_PORT``...) and its own torch.distributed world; it runs the same
``thinpipe train --engine dist`` (or ``--engine elastic``) as torchrun's ranks do.

Fork safety: the server imports modules and runs nothing else, so no thread pool, CUDA context or torchft
runtime exists to be copied; ``OMP_NUM_THREADS`` is set before it starts, since OpenMP reads it once, at load.
The server ignores Ctrl-C and outlives no rank: each rank holds its pipe open (multiprocessing's design), and watches
the launcher itself (``$THINPIPE_WATCH_PID``, ``comm/orphan.py``), not its parent the server: a launcher killed
with SIGKILL takes its ranks, then its server, with it.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading

from setproctitle import setproctitle
from tqdm import tqdm


def _run_rank(argv: list[str], env: dict[str, str], title: str) -> None:
    """The body of a forked rank: a new session (as ``Popen(start_new_session=True)``), its own environment, the
    default signal handlers, its name in ps/top (``title``, else every rank would show the server's command line),
    then ``thinpipe <argv>``; the exit code is the command's."""
    os.setsid()
    setproctitle(f"{title}: thinpipe {' '.join(argv)}")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    # tqdm's default lock is a multiprocessing semaphore, registered with the server's resource tracker: a rank
    # killed mid-run would leave it behind and the tracker would warn at the job's end. One rank is one process.
    tqdm.set_lock(threading.RLock())
    sys.argv = ["thinpipe", *argv]
    runpy.run_module("thinpipe", run_name="__main__", alter_sys=True)  # as `python -m thinpipe <argv>` does


class RankProcess:
    """One forked rank, with the part of ``subprocess.Popen`` the launchers use (``poll``, ``wait``,
    ``terminate``, ``kill``, ``pid``): an exit code, or ``-N`` for a rank that signal N ended."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._p = process

    @property
    def pid(self) -> int | None:
        return self._p.pid

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        code = self._p.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self._p.pid}", timeout or 0.0)
        return code

    def terminate(self) -> None:
        if self._p.exitcode is None:
            self._p.terminate()

    def kill(self) -> None:
        if self._p.exitcode is None:
            self._p.kill()


START_METHODS = ("forkserver", "spawn")  # as torchrun's --start-method; spawn: a fresh `python -m thinpipe` each


class RankStarter:
    """Starts ranks as ``thinpipe <argv>``: forked from one server that has imported ``preload`` (module names;
    ``forkserver``, the default) or each a fresh ``python -m thinpipe`` (``spawn``, the way before; for a
    platform where forking a process that has imported torch misbehaves).

    The server is a fresh interpreter (started with the first rank, so a launcher's own threads, torchft's
    lighthouse say, are not copied into it) with the launcher's environment at that moment, and
    ``OMP_NUM_THREADS`` set (``omp_threads``) as every rank's is."""

    def __init__(self, preload: list[str], omp_threads: str, method: str = "forkserver"):
        if method not in START_METHODS:
            raise ValueError(f"start method {method!r} is not one of {START_METHODS}")
        self.method = method
        os.environ["OMP_NUM_THREADS"] = omp_threads
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(preload)

    def start(self, argv: list[str], env: dict[str, str], title: str) -> subprocess.Popen | RankProcess:
        """``thinpipe <argv>`` in environment ``env``, named ``title`` in ps (e.g. ``thinpipe rank 3 (fast replica
        1, stage 1)``; a spawned rank shows its command line)."""
        if self.method == "spawn":
            return subprocess.Popen([sys.executable, "-m", "thinpipe", *argv], env=env, start_new_session=True)
        p = self._ctx.Process(target=_run_rank, args=(argv, env, title), name=title)
        p.start()
        return RankProcess(p)
