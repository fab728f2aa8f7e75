"""The errors the command line turns into one line and an exit code (2: bad input, 3: divergence), and the
way a job of several ranks prints such a line once."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path


class ConfigError(ValueError):
    """A user error in the configuration; the message says what is wrong and how to fix it."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the last good checkpoint."""


# ---------------------------------------------------------------------------------- one line per job

RANK_ERRORS_ENV = "THINPIPE_RANK_ERRORS"  # set by `thinpipe launch` for its ranks: a private folder


def report(message: str) -> None:
    """``error: message`` on stderr; in a rank of ``thinpipe launch`` (``$THINPIPE_RANK_ERRORS``) the line goes
    to the launcher instead, which prints each distinct error of the job once (a bad input that every rank
    finds would otherwise print the same line once per rank)."""
    folder = os.environ.get(RANK_ERRORS_ENV)
    if folder:
        try:
            path = Path(folder) / f"rank{int(os.environ.get('RANK', '0')):05d}"
            path.with_suffix(".tmp").write_text(message)
            os.replace(path.with_suffix(".tmp"), path)  # whole: the launcher may read while this rank is stopped
            return
        except (OSError, ValueError):  # the launcher's folder is gone: say it here
            pass
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def rank_errors():
    """(the environment for a job's ranks, a function returning their distinct error lines in rank order)."""
    with tempfile.TemporaryDirectory(prefix="thinpipe-errors-") as folder:
        def lines() -> list[str]:
            found = [p.read_text(errors="replace") for p in sorted(Path(folder).glob("rank?????"))]
            return list(dict.fromkeys(m for m in found if m))
        yield {RANK_ERRORS_ENV: folder}, lines
