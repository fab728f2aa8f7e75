"""Recipes: a whole system of the papers as one TOML file shipped in the package (``thinpipe/config/recipes/``).

``thinpipe train --recipe NAME`` starts from the recipe, then ``--config``, then ``--set``: a recipe is a
config file that a user does not have to write. Its first line (a comment) is what ``thinpipe recipes``
prints for it; the comment block under it cites the paper sections its values come from. One place to add
one: drop a TOML file in ``recipes/`` (the tests check that each one loads and trains).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from thinpipe.config.errors import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_names() -> list[str]:
    """Every shipped recipe, sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def recipe_path(name: str) -> Path:
    """The TOML file of recipe ``name``; an unknown name is one line naming the close one or all of them."""
    names = recipe_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(names)}"
        raise ConfigError(f"{name!r} is not a recipe: {hint} (`thinpipe recipes` lists them)")
    return RECIPES_DIR / f"{name}.toml"


def recipe_summary(name: str) -> str:
    """The recipe's one line: the first comment line of its file."""
    first = recipe_path(name).read_text(encoding="utf-8").splitlines()[0]
    return first.lstrip("#").strip()
