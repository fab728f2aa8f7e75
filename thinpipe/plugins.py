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
from collections.abc import Callable

PLUGIN_BOUNDARIES: dict[str, Callable] = {}


def register_boundary(name: str, build: Callable) -> None:
    PLUGIN_BOUNDARIES[name] = build


def load_plugins() -> None:
    for name in filter(None, (m.strip() for m in os.environ.get("THINPIPE_PLUGINS", "").split(","))):
        importlib.import_module(name)
