"""Log lines of a rank on the real mesh."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """One log line to stderr in a single write: every rank shares the launcher's stderr, and
    ``print`` writes the text and its newline separately, so lines of different ranks would splice."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
