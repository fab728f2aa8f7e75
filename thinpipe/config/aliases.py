"""Other names of config keys: each still works and is renamed to its key.

Deprecated keys say so on stderr: ``boundary.anchor`` was MAPL's per-stage token-dependent offset; it is
``boundary.offset`` now, so that "anchor" means only the anchor circuit (``mesh.anchor``, ``[anchor]``).

Flat keys are silent aliases: a boundary kind's own settings are its table ``[boundary.<kind>]``, and its flat key
of before (``boundary.klt_bits``, ``boundary.outlier_channels``, ``boundary.vq_codes``, ``boundary.tah_high_fraction``,
``boundary.ssn_refresh_every``) names the same setting (``boundary.klt.bits``, ...): the kind's ``flat_prefix`` +
the table's key (``config/boundary_kinds.py``). Old TOML files, old run folders (their ``config.toml``) and ``--set``
with either name keep working.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from thinpipe.config.errors import ConfigError
from thinpipe.plugins import BOUNDARY_KINDS

# old dotted key -> (new dotted key, why it moved)
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "boundary.anchor": ("boundary.offset", "MAPL's per-stage offset; \"anchor\" is the anchor circuit"),
}


def _same(a: Any, b: Any) -> bool:
    """Equal as given, ignoring the spaces a ``--set`` string may carry."""
    return (a.strip() if isinstance(a, str) else a) == (b.strip() if isinstance(b, str) else b)


def flat_aliases() -> dict[str, str]:
    """Every registered kind's flat keys: ``boundary.<flat_prefix><key>`` -> ``boundary.<kind>.<key>``."""
    return {f"boundary.{spec.flat_prefix}{f.name}": f"boundary.{name}.{f.name}"
            for name, spec in BOUNDARY_KINDS.items() if spec.flat_prefix for f in dataclasses.fields(spec)}


def rename_deprecated(values: dict[str, Any], source: str, warned: set[str] | None = None) -> dict[str, Any]:
    """``values`` (flat dotted keys) with every deprecated key and flat alias renamed to its key, in order.

    Each deprecated key used prints one warning line to stderr (once per key across calls that share
    ``warned``); a flat alias is silent. Giving both names with different values is a ``ConfigError``."""
    warned = set() if warned is None else warned
    flat = flat_aliases()
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in flat:
            new = flat[key]
            if new in values and not _same(values[new], value):
                raise ConfigError(f"{source}: {key} = {value!r} and {new} = {values[new]!r} disagree; {key} is "
                                  f"another name of {new}: give one")
            out.setdefault(new, value)
            continue
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

