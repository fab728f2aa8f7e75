"""Rows of a JSON-lines file that a crash may have cut off (``metrics.jsonl``).

A row is appended and flushed as its step ends, so a process killed mid-write leaves at most its
last line cut off (no newline, not JSON). That line is dropped with one warning; a damaged line
anywhere else was not left by a crash and is refused in one line (docs/reliability.md, "Nothing is lost").
"""

from __future__ import annotations

import json
from pathlib import Path

from thinpipe.config import ConfigError
from thinpipe.console import say


def read_rows(path: Path, warn=say) -> list[dict]:
    """Every row of ``path`` (none if it does not exist); ``warn``: where the cut-off last line is
    reported (None: not reported, e.g. on every rank but the one that writes the folder)."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): restore it or remove it") from None
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    rows = []
    for i, line in numbered:
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            if i == numbered[-1][0]:  # what a process killed mid-write leaves
                if warn is not None:
                    warn(f"[thinpipe] warning: {path} ends in a cut-off line {i} ({len(line)} characters, not JSON), "
                         "left by a crash: dropped")
                break
            raise ConfigError(f"{path} line {i} is not a JSON row ({str(e)[:80]}): restore the file or remove "
                              "that line") from None
        rows.append(row)
    return rows
