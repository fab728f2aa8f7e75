"""``thinpipe keygen``: a new job key for a dist job across machines, the secret by which each rank proves it
belongs to the job (``comm/jobkey.py``, docs/security.md)."""

from __future__ import annotations

import argparse

from thinpipe.comm.jobkey import KEY_ENV, write_key_file
from thinpipe.console import say

NAME = "keygen"
HELP = "write a new job key (for a dist job across machines: docs/security.md)"


def add_arguments(k: argparse.ArgumentParser) -> None:
    k.add_argument("file", metavar="KEYFILE", help="where to write it (mode 0600; never overwritten)")


def run(args) -> int:
    path = write_key_file(args.file)
    say(f"wrote a job key to {path}: copy it to every machine of the job (scp; never into a config or a run folder) "
        f"and set {KEY_ENV}={path} for each rank")
    return 0
