"""One module per ``thinpipe`` command, and the helpers the commands share.

Each command module has the same shape: ``NAME`` (the command), ``HELP`` (its line in ``thinpipe
--help``), ``add_arguments(parser)`` (its options) and ``run(args) -> int`` (its body and its printing,
returning the exit code). ``thinpipe/cli.py`` is the registry that builds the parser from them and
turns their errors into one line and an exit code (docs/architecture.md).

The registry imports every command module to build its parser, so a command module imports what its
body computes with (a model, matplotlib, torchft, an optional dependency) inside ``run``, or keeps it
in a library module of its own (``probe_lib.py``, ``prune_lib.py``, ``analyze_lib.py``): ``thinpipe
--help`` and every other command then start without it.
"""
