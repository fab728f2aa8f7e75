"""One job per run folder: an exclusive lock on ``OUT/.thinpipe.lock`` for the whole life of the job that writes it.

docs/reliability.md ("One job per folder"). Two processes writing one folder would interleave their
metrics rows and checkpoints and both exit 0; the second is refused instead, in one line naming the
holder. The lock is ``flock(2)`` on a file in the folder: the kernel releases it when its holder
dies, however it dies (SIGKILL, OOM), so the lock of a dead process is simply taken over. The file
holds the holder's pid and host, for the refusal line only; it is never removed (removing a lock
file races with a process that has just opened it).

The lock belongs to the job, not to a process: ``thinpipe launch`` (and ``--elastic``) takes it and
names it in ``THINPIPE_RUN_LOCK_HELD`` for its children; a rank skips the lock when that variable
names its folder's lock and the lock is really held. Under torchrun without the launcher, rank 0
takes it (it writes the folder).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from thinpipe.config import ConfigError

LOCK_FILE = ".thinpipe.lock"
HELD_ENV = "THINPIPE_RUN_LOCK_HELD"  # the lock file a launcher holds for its job's processes


def check_out_path(out: Path, flag: str = "--out") -> None:
    """A folder to write must not be a file, nor lie under one (mkdir would traceback)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a folder: give a folder path")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {out} lies under {parent}, which is a file: give a folder path")
            return


class RunLock:
    """A held lock (or none: ``fd`` None, when the job's launcher or rank 0 holds it for this process)."""

    def __init__(self, path: Path | None = None, fd: int | None = None, job: bool = False):
        self.path, self.fd, self.job = path, fd, job
        self._env = os.environ.get(HELD_ENV)
        if job and fd is not None:  # the job's processes inherit the name of the lock held for them
            os.environ[HELD_ENV] = str(path)

    def release(self) -> None:
        if self.fd is None:
            return
        if self.job:
            if self._env is None:
                os.environ.pop(HELD_ENV, None)
            else:
                os.environ[HELD_ENV] = self._env
        os.close(self.fd)  # closing the only descriptor of the open file releases the flock
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __del__(self):  # a lock dropped without release() (an exception on the way) is given back with it
        try:
            self.release()
        except Exception:
            pass


def is_held(path: Path) -> bool:
    """Whether some open file holds ``path``'s flock (a probe: taken and given back at once when free)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # also gives a probe's lock back
    return False


def holder(path: Path) -> str:
    """'pid N on HOST since HH:MM:SS' from the lock file, as far as it can be read."""
    try:
        info = json.loads(Path(path).read_text())
        since = time.strftime("%H:%M:%S", time.localtime(info["since"]))
        return f"pid {int(info['pid'])} on {info['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def take_run_lock(out: Path, lead: bool = True, job: bool = False, create: bool = True) -> RunLock:
    """Hold ``out``'s lock until ``release()`` (or this process ends); refused in one line while another job holds it.

    ``lead``: this process is the one that writes the folder (a dist rank other than 0 takes nothing);
    ``job``: a launcher, whose child processes are then not refused; ``create``: make the folder
    (False for --resume, whose missing folder is refused later with its own line)."""
    out = Path(out)
    check_out_path(out)
    path = out.resolve() / LOCK_FILE
    if os.environ.get(HELD_ENV) == str(path) and is_held(path):
        return RunLock()  # this process belongs to the job whose launcher holds the lock
    if not lead or (not create and not out.is_dir()):
        return RunLock()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"--out {out}: cannot lock {path} ({e.strerror}): choose a folder on a local file system")
        raise ConfigError(f"--out {out} is in use by another thinpipe job ({holder(path)}): wait for it to end, or "
                          "choose another --out (two jobs in one folder would mix their metrics and checkpoints)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
    return RunLock(path, fd, job)
