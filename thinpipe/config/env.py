"""Environment variables read as checked values: a wrong one is a ``ConfigError`` naming the variable and
what it accepts (one line, exit 2), never a ``ValueError`` traceback from deep inside a rank."""

from __future__ import annotations

import math
import os
from typing import overload

from thinpipe.config.errors import ConfigError


def env_float(name: str, default: float, lo: float, hi: float) -> float:
    """``$name`` as a number in [lo, hi], or ``default`` when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:  # nan fails too
        raise ConfigError(f"${name} = {text!r}: give a number from {lo:g} to {hi:g} (default {default:g}), or unset it")
    return value


# typed per default: an int default gives an int; None gives None when unset or empty
@overload
def env_int(name: str, default: int, lo: int, hi: int) -> int: ...


@overload
def env_int(name: str, default: None, lo: int, hi: int) -> int | None: ...


def env_int(name: str, default: int | None, lo: int, hi: int) -> int | None:
    """``$name`` as an integer in [lo, hi], or ``default`` when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        unset = ", or unset it" if default is not None else ""
        raise ConfigError(f"${name} = {text!r}: give an integer from {lo} to {hi}"
                          f"{f' (default {default})' if default is not None else ''}{unset}")
    return value


def dist_timeout_s() -> float:
    """``$THINPIPE_DIST_TIMEOUT_S``: how long a rank waits on a silent peer before it fails (docs/distributed.md);
    one second to a week."""
    return env_float("THINPIPE_DIST_TIMEOUT_S", 60.0, 1.0, 7 * 86400.0)


def env_path(name: str, default: str) -> str:
    """``$name`` as a folder path (created by the caller), or ``default`` when unset or empty; refused when it
    names something that exists and is not a folder."""
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    if os.path.exists(text) and not os.path.isdir(text):
        raise ConfigError(f"${name} = {text!r} is a file, not a folder: give a folder (created if missing), or unset "
                          "it")
    return text
