"""Deprecated config keys: each still works, is renamed to its new key, and says so on stderr.

``boundary.anchor`` was MAPL's per-stage token-dependent offset; it is ``boundary.offset`` now, so
that "anchor" means only the anchor circuit (``mesh.anchor``, ``[anchor]``). Old TOML files, old
run folders (their ``config.toml``) and ``--set boundary.anchor=...`` keep working.
"""

from __future__ import annotations

import sys
from typing import Any

from thinpipe.config.errors import ConfigError

# old dotted key -> (new dotted key, why it moved)
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "boundary.anchor": ("boundary.offset", "MAPL's per-stage offset; \"anchor\" is the anchor circuit"),
}


def _same(a: Any, b: Any) -> bool:
    """Equal as given, ignoring the spaces a ``--set`` string may carry."""
    return (a.strip() if isinstance(a, str) else a) == (b.strip() if isinstance(b, str) else b)


def rename_deprecated(values: dict[str, Any], source: str, warned: set[str] | None = None) -> dict[str, Any]:
    """``values`` (flat dotted keys) with every deprecated key renamed to its new key, in order.

    Each deprecated key used prints one warning line to stderr (once per key across calls that share
    ``warned``). Giving both the old and the new key with different values is a ``ConfigError``."""
    warned = set() if warned is None else warned
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in DEPRECATED_KEYS:
            out[key] = value
            continue
        new, why = DEPRECATED_KEYS[key]
        if new in values and not _same(values[new], value):
            raise ConfigError(f"{source}: {key} = {value!r} and {new} = {values[new]!r} disagree; {key} is a "
                              f"deprecated name of {new}: give {new} only")
        if key not in warned:
            warned.add(key)
            print(f"[thinpipe] warning: {key} is deprecated: use {new} ({why})", file=sys.stderr)
        out.setdefault(new, value)
    return out

