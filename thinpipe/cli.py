"""The one command line: ``thinpipe train | launch | plan | bench | probe | eval | generate | compare | export | prune |
analyze | recipes | keygen | demo``.

User errors (bad keys, types, values, paths, names) end with one line ``error: ...`` saying what is
wrong and how to fix it, and exit code 2, before any model or data is loaded.

This module is the registry: each command is one module of ``thinpipe/commands/`` (its options, its body,
its printing); here they become one parser, and their errors one line and an exit code.
"""

from __future__ import annotations

import sys

from thinpipe.commands import (
    analyze,
    bench,
    compare,
    demo,
    evaluate,
    export,
    generate,
    keygen,
    launch,
    plan,
    probe,
    prune,
    recipes,
    top,
    train,
)
from thinpipe.commands.common import EXIT_DIVERGED, EXIT_USAGE, Parser
from thinpipe.commands.common import build_parser as parser_of
from thinpipe.config import ConfigError, Diverged
from thinpipe.config.errors import report
from thinpipe.eval.sandbox import SandboxUnavailable
from thinpipe.plugins import PluginError, load_plugins

__all__ = ["COMMANDS", "EXIT_DIVERGED", "EXIT_USAGE", "Parser", "build_parser", "main"]

# in the order of `thinpipe --help`
COMMANDS = [train, launch, plan, bench, top, evaluate, generate, export, prune, analyze, probe, compare, recipes,
            keygen, demo]


def build_parser() -> Parser:
    return parser_of(COMMANDS, description=__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        load_plugins()  # boundary kinds named in THINPIPE_PLUGINS (plugins.py)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error, already printed as one line (2)
        return int(e.code or 0)
    run = {c.NAME: c.run for c in COMMANDS}[vars(args).pop("command")]  # the command sees its own options only
    try:
        return run(args)
    except ConfigError as e:
        report(str(e))  # a rank of `thinpipe launch` hands it to the launcher: the job prints it once
        return EXIT_USAGE
    except SandboxUnavailable as e:  # a machine that cannot isolate generated code: it is never run
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
