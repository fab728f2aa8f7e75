"""What both launchers of local rank processes share (``launch.py``: one job of N ranks; ``launch_elastic.py``:
replicas that may fail and come back): the ranks' command line, a free port for a rendezvous, the job key's
environment (docs/security.md), and how a process ended and is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from thinpipe.comm.jobkey import KEY_ENV, write_key_file
from thinpipe.config import ConfigError

INTERRUPTED = 130  # the shell's exit status for a job stopped by SIGINT


def train_args(rest: list[str]) -> list[str]:
    rest = [a for a in rest if a != "--"]
    if not rest or rest[0] != "train":
        raise ConfigError("thinpipe launch runs a training job: thinpipe launch --nproc N -- train --out DIR ...")
    return rest


def free_port() -> int:
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


def how(code: int) -> str:
    """A process's exit status in words: ``exit code N`` or ``signal SIGNAME``."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def failures(codes: list[int | None]) -> list[tuple[int, int]]:
    """(index, exit status) of the processes that failed, those a signal ended first: seen at one look, a rank
    killed and its peer that exited on the broken link, the killed one is the root cause."""
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    return sorted(failed, key=lambda ic: ic[1] >= 0)


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0, terminate: bool = True) -> None:
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
