"""What the commands share: the exit codes, the parser whose errors are one line, the ``--device`` option,
and the parser made of a list of command modules (``cli.py`` makes it of all of them)."""

from __future__ import annotations

import argparse
import re

EXIT_USAGE = 2  # a bad input (a key, type, value, path or name), reported as one line before anything loads
EXIT_DIVERGED = 3  # training produced a non-finite loss or gradient norm


class Parser(argparse.ArgumentParser):
    """argparse's errors as one line (``error: ...``, exit 2) like every other bad input, not usage + error.

    ``strict``: an argument this parser does not know is its own error (naming its own ``--help``), not the
    top parser's (argparse hands a sub-command's unknown arguments up to the parser above it)."""

    strict = False

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.strict:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser(commands: list, description: str | None = None) -> Parser:
    """``thinpipe`` with one sub-command per module of ``commands`` (``NAME``, ``HELP``, ``add_arguments``);
    the parsed namespace's ``command`` is the chosen module's ``NAME``."""
    p = Parser(prog="thinpipe", description=description)
    sub = p.add_subparsers(dest="command", required=True)
    for command in commands:
        command.add_arguments(sub.add_parser(command.NAME, help=command.HELP))
    return p


def parse_device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: give auto, cpu, cuda or cuda:N")
    return value


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", type=parse_device,
                   help="auto (CUDA when available) | cpu | cuda | cuda:N; a run loads on any device, whatever it "
                        "trained on")
