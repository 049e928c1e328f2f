"""The user-facing error of the command line (its own module, so the sub-command modules and ``cli`` share it
without importing each other)."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing error: printed as one line on stderr, exit status 1."""
