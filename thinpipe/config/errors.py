"""The one exception every configuration check raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration; the message says what is wrong and how to fix it."""
