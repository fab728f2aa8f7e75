"""``thinpipe recipes``: the shipped systems of the papers (``thinpipe/config/recipes/``), one line each, or one
recipe's whole file (its values and the paper sections they come from)."""

from __future__ import annotations

import argparse

from thinpipe.config.recipe import recipe_names, recipe_path, recipe_summary

NAME = "recipes"
HELP = "list the shipped recipes (thinpipe train --recipe NAME), or show one"


def add_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("name", nargs="?", help="show this recipe's TOML (its values and their sources)")


def run(args) -> int:
    if args.name:
        print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
        return 0
    names = recipe_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {recipe_summary(name)}")
    print("\nthinpipe train --recipe NAME --out DIR [--set KEY=VALUE ...]; thinpipe recipes NAME shows one")
    return 0
