"""Which code produced a result: thinpipe's version and the git commit of the source tree it was imported from.

Every ``summary.json`` and every experiment's or benchmark's result file carries this stamp
(experiments/README.md, "Provenance"), so a number can be traced to the code that computed it.

``commit`` is ``git rev-parse HEAD`` of the checkout that holds the imported package, and "unknown"
when there is none: git absent, the package outside any repository, or installed into a folder that
git does not track (a virtual environment inside a checkout must not borrow that checkout's commit).
``dirty`` says whether tracked files of that checkout differ from the commit (so the commit alone
does not name the code); None when the commit is unknown. Each is asked once per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

UNKNOWN = "unknown"
PACKAGE = Path(__file__).resolve().parent


def _git(root: Path, *args: str) -> str | None:
    """git's stdout, or None when git is absent or fails; never prints. GIT_OPTIONAL_LOCKS=0: a status
    must not take the index lock from someone committing in the same checkout."""
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                           env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def code_stamp(root: Path = PACKAGE) -> dict:
    """{"version", "commit", "dirty"} of the package whose ``__init__.py`` lies in ``root`` (thinpipe's own by
    default): a fresh dict each call, for the caller to merge into its result."""
    return dict(_stamp(Path(root).resolve()))


@functools.lru_cache(maxsize=None)
def _stamp(root: Path) -> tuple:
    # ``version`` is the loaded package's ``__version__``: reading it, not importing it, keeps this module in the
    # foundation layer (the package's ``__init__`` ran before any of its modules).
    version = getattr(sys.modules.get(__package__ or ""), "__version__", UNKNOWN)
    head = _git(root, "rev-parse", "HEAD")
    tracked = _git(root, "ls-files", "--error-unmatch", "--", "__init__.py")
    commit = head.strip() if head and tracked is not None else UNKNOWN
    dirty = None
    if commit != UNKNOWN:
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status.strip())
    return ("version", version), ("commit", commit), ("dirty", dirty)
