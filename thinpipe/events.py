"""``events.jsonl``: what happened to an elastic job's membership, one JSON object per line.

Written by the launcher (a replica's processes started, died, restarted, gave up) and by the
replicas (a quorum formed without someone, someone joined and recovered, a step was rolled back).
Several processes append to one file: each line is one ``os.write`` on an ``O_APPEND`` descriptor,
so lines never interleave on a local file system. Keys: ``event``, ``time`` (Unix seconds),
``wall_s`` (since the job started, when known), ``step`` (the training step, when known), then the
event's own fields (docs/elastic.md lists them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from thinpipe.jsonl import read_rows

EVENTS = "events.jsonl"


def append_event(job: Path, event: str, /, **fields) -> dict:
    row = {"event": event, "time": round(time.time(), 3), **fields}
    job.mkdir(parents=True, exist_ok=True)
    fd = os.open(job / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)
    return row


def read_events(folder: Path) -> list[dict]:
    """The job's events; a last line cut off by a crash is dropped with a warning (``jsonl.py``)."""
    return read_rows(folder / EVENTS)
