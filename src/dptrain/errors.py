"""The errors a user can fix, each raised with one sentence that says what is wrong and what to do. The CLI prints
that sentence alone (exit code 2 for a configuration, data or snapshot refused before anything started; 1 for the
others); the details go to logs/."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one sentence saying what to change."""


class DataError(ValueError):
    """A dataset file is missing, truncated or corrupt; the message names the file and the fix."""


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message names it and what is wrong."""


class UnsafeFileError(ValueError):
    """A file or folder that could run code on load or that others could have written; the message says which."""


class LaunchError(RuntimeError):
    """The environment describes a world that cannot be joined; the message says what to fix."""


class OutputError(RuntimeError):
    """The run folder could not be written; the message names the path and the cause."""
