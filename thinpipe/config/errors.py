"""The errors the command line turns into one line and an exit code (2: bad input, 3: divergence)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration; the message says what is wrong and how to fix it."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the last good checkpoint."""
