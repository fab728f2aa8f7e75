"""The registry of boundary kinds (built-in and plug-in), and plug-ins from outside the package (a user's or a
test's).

A boundary kind describes itself with a ``BoundaryKind`` (below): a dataclass whose fields are its own settings (the
``[boundary.<name>]`` table) and whose class attributes are its properties (architectural, default bits, ...). It is
torch-free and lives in this lowest layer so that the config layer can parse and check every kind's table before
torch loads; the ``Boundary`` class that implements it (``thinpipe/boundary/``) names it with
``boundary/base.py: implements``. The built-in kinds' descriptions are ``config/boundary_kinds.py``.

A plugin module registers a kind when imported: ``register_boundary(MyKind)`` (a ``BoundaryKind`` subclass, built by
the ``Boundary`` class that ``implements`` it, or by its own ``build``), or in the short form
``register_boundary(name, build, architectural=..., ...)``, where ``build(cfg, index, hidden_size, seed, wire_dtype,
model, shared) -> Boundary`` makes boundary ``index`` (``cfg``: the ``boundary`` config section; ``shared``: a dict
that lives for one replica's boundaries, for state they share). ``THINPIPE_PLUGINS`` (comma-separated module names)
lists the modules the CLI imports at start-up, in every rank of a distributed run. It is read from the environment
only, never from a run folder, so that loading someone's run never imports code.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable
from typing import Any

BOUNDARY_KINDS: dict[str, type[BoundaryKind]] = {}  # boundary.kind -> its description, built-in and plug-in alike
PLUGIN_DP_SCHEMES: dict[str, type] = {}  # dp.kind -> a ``dp/scheme.py: DPScheme`` subclass (``register_dp_scheme``)
PLUGIN_OBJECTIVES: dict[str, object] = {}  # name -> objective/spec.py: ObjectiveSpec (a layer above this module)
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # dotted identifiers: what import takes


class PluginError(Exception):
    """A bad ``$THINPIPE_PLUGINS``: the CLI prints it as one line, exit 2, like a ``ConfigError`` (which lives a
    layer above this module)."""


class BoundaryKind:
    """A boundary kind's description: subclass it as a ``@dataclass(kw_only=True, slots=True)`` whose fields (each
    with a docstring) are the kind's own settings, ``[boundary.<name>]`` in a config, and set the class attributes
    below that differ from the defaults. The config builds one with the values given, checks it with ``validate``
    and reads the properties; ``build`` makes the boundaries."""

    __slots__ = ()
    name = ""
    """``boundary.kind``, and the name of the kind's settings table."""
    architectural = False
    """True: the boundary is part of the model (training and evaluation run through it, ``export`` refuses it):
    it applies to every boundary and refuses the anchor circuit, ``diag.every`` and GSPO's KL reference."""
    default_bits: tuple[int, int] = (0, 0)
    """(forward, backward) bits per value that ``boundary.fwd_bits`` / ``bwd_bits`` = 0 stand for (quantisers)."""
    one_way = False
    """True: ``boundary.compress`` may leave one direction dense (fwd / bwd); other kinds refuse it."""
    flat_prefix = ""
    """The prefix of the table's flat aliases: ``boundary.<flat_prefix><key>`` is ``boundary.<name>.<key>``."""
    needs_model = ""
    """Why the kind cannot be built without the model's weights (its bytes depend on them), or "": the planner,
    which has an architecture and no weights, refuses such a kind with this reason."""
    implementation: Any = None
    """The ``Boundary`` class that builds it (set by ``boundary/base.py: implements``)."""

    def validate(self, boundary: Any) -> None:
        """Refuse a bad value of the kind's own settings (``boundary``: the whole ``[boundary]`` section, for the
        shared settings the kind constrains when it is ``boundary.kind``) with a one-line ``ValueError``."""

    def check_stages(self, boundary: Any, stages: int) -> None:
        """Refuse settings that do not fit a pipeline of ``stages`` stages (``mesh.pp``) with a ``ValueError``."""

    @classmethod
    def build(cls, cfg: Any, index: int, hidden_size: int, seed: int, wire_dtype: Any, model: Any,
              shared: dict) -> Any:
        """Boundary ``index`` of this kind (``cfg``: the ``[boundary]`` section)."""
        if cls.implementation is None:
            raise ValueError(f"boundary kind {cls.name!r} has no implementation: decorate its Boundary class with "
                             "thinpipe.boundary.base.implements or give it a build")
        return cls.implementation.from_config(cfg, index, hidden_size, seed, wire_dtype, model, shared)


def register_boundary(kind: type[BoundaryKind] | str, build: Callable | None = None,
                      **properties: Any) -> type[BoundaryKind]:
    """Register a boundary kind: a ``BoundaryKind`` subclass, or the short form: its name, its builder and its
    properties as keywords (``BoundaryKind``'s class attributes), with no settings of its own. Returns the
    description (registering a name again replaces it)."""
    if isinstance(kind, str):
        unknown = sorted(set(properties) - {"architectural", "default_bits", "one_way", "needs_model"})
        if unknown:
            raise TypeError(f"register_boundary: unknown properties {unknown}")
        attrs = {"name": kind, **properties}
        if build is not None:
            attrs["build"] = staticmethod(build)
        kind = type(f"BoundaryKind_{kind}", (BoundaryKind,), attrs)
    elif build is not None or properties:
        raise TypeError("register_boundary: a BoundaryKind class carries its build and properties itself")
    if not (isinstance(kind, type) and issubclass(kind, BoundaryKind)) or not kind.name:
        raise TypeError(f"register_boundary: {kind!r} is not a BoundaryKind subclass with a name")
    if not dataclasses.is_dataclass(kind):
        kind = dataclasses.dataclass(kw_only=True)(kind)
    BOUNDARY_KINDS[kind.name] = kind
    return kind


def register_objective(spec) -> None:
    """An objective from outside the package: its ``objective/spec.py: ObjectiveSpec`` (``train.objective =
    spec.name`` then selects it; docs/architecture.md: a new objective)."""
    PLUGIN_OBJECTIVES[spec.name] = spec


def register_dp_scheme(name: str, scheme: type) -> None:
    """``dp.kind = name`` runs ``scheme``, a subclass of ``thinpipe.dp.scheme.DPScheme`` (docs/dp.md)."""
    PLUGIN_DP_SCHEMES[name] = scheme


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
