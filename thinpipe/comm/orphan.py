"""A rank of a launcher exits when its launcher is gone (SIGKILL, a lost node) instead of training on as an orphan.

A launcher starts each rank in its own session (so that the terminal's Ctrl-C reaches only the launcher, which
stops the ranks in order): nothing else would stop a rank whose launcher died, and it would keep training and
holding its machine. docs/distributed.md.
"""

from __future__ import annotations

import os
import select
import threading
import time

from thinpipe.console import say


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


WATCH_ENV = "THINPIPE_WATCH_PID"  # the pid of the launcher a rank of `thinpipe launch` exits with


def exit_with_launcher() -> None:
    """Exit this rank when its launcher dies (SIGKILL, lost node): a launcher starts each rank in its own
    session, so nothing else would stop an orphaned rank, which would keep training and holding its machine.
    Only for ranks a launcher started: ``thinpipe launch`` names itself in ``$THINPIPE_WATCH_PID`` (its ranks are
    forked by its fork server, not by it: commands/rank_starter.py); under torchrun (``$TORCHELASTIC_RUN_ID``)
    the launcher is the rank's parent, its agent."""
    watched = os.environ.get(WATCH_ENV)
    if watched is None and "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    pid = int(watched) if watched else os.getppid()
    try:
        handle: int | None = os.pidfd_open(pid)  # readable once that process has exited (Linux >= 5.3)
    except ProcessLookupError:
        handle = None  # gone already
    except (AttributeError, OSError):
        handle = -1  # no pidfds here: look every second (a launcher that is a zombie counts as alive then)

    def watch():
        if handle is not None and handle >= 0:
            select.select([handle], [], [])
        while handle == -1 and _alive(pid):
            time.sleep(1.0)
        say(f"[thinpipe rank {os.environ.get('RANK', '?')}] its launcher (pid {pid}) is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="thinpipe-launcher-watch", daemon=True).start()
