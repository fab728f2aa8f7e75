"""Boundary kinds from outside the package (a user's or a test's), registered by name.

A plugin module calls ``register_boundary(name, build)`` when imported, where
``build(cfg, index, hidden_size, seed, wire_dtype, model, shared) -> Boundary`` makes boundary
``index`` (``cfg``: the ``boundary`` config section; ``shared``: a dict that lives for one replica's
boundaries, for state they share). ``THINPIPE_PLUGINS`` (comma-separated module names) lists the
modules the CLI imports at start-up, in every rank of a distributed run. It is read from the
environment only, never from a run folder, so that loading someone's run never imports code.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

PLUGIN_BOUNDARIES: dict[str, Callable] = {}
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # dotted identifiers: what import takes


class PluginError(Exception):
    """A bad ``$THINPIPE_PLUGINS``: the CLI prints it as one line, exit 2, like a ``ConfigError`` (which lives a
    layer above this module)."""


def register_boundary(name: str, build: Callable) -> None:
    PLUGIN_BOUNDARIES[name] = build


def load_plugins() -> None:
    """Import each module of ``$THINPIPE_PLUGINS``; a name that is not a module, is not found or fails to import
    is one ``PluginError`` naming it (the plugin's own traceback is its author's to read, with ``python -c
    "import NAME"``)."""
    for name in filter(None, (m.strip() for m in os.environ.get("THINPIPE_PLUGINS", "").split(","))):
        if not MODULE_NAME.fullmatch(name):
            raise PluginError(f"$THINPIPE_PLUGINS names {name!r}, which is not a module name: give comma-separated "
                              "importable modules, e.g. THINPIPE_PLUGINS=my_pkg.boundaries (not a file path)")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):  # a module it imports
                raise PluginError(f"$THINPIPE_PLUGINS: plugin {name!r} failed to import: {e}") from None
            raise PluginError(f"$THINPIPE_PLUGINS names module {name!r}, which is not installed or not on "
                              "PYTHONPATH: install it, fix the name, or unset THINPIPE_PLUGINS") from None
        except Exception as e:  # noqa: BLE001  (any error of the plugin's own code: one line naming the plugin)
            raise PluginError(f"$THINPIPE_PLUGINS: plugin {name!r} failed to import: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
