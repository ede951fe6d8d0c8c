"""Errors the user can fix. The command line prints them as one line and exits with status 2.

Raise a `UsageError` (or a subclass) for anything the person running vrl can act on: a bad option,
a missing file, an unreachable model hub or verifier server, a run directory in use. Its message
says what is wrong and how to fix it, in one line. Anything else is a bug and keeps its traceback
(`vrl -v`).
"""

from __future__ import annotations


class UsageError(Exception):
    """A problem with the user's input or setup, phrased for them: what is wrong and how to fix it."""


class OptionsError(UsageError, ValueError):
    """An environment option (`-o KEY=VALUE`) that is unknown or has a value of the wrong type."""


class UnknownSplitError(UsageError, ValueError):
    """A split the environment does not have."""


class ModelUnavailable(UsageError):
    """The model cannot be loaded: no such path, not a valid hub id, or not cached and the hub is unreachable."""


class DatasetUnavailable(UsageError):
    """A dataset cannot be loaded: no such file, or not cached and the hub is unreachable."""


class SelectionError(UsageError, ValueError):
    """`es.include` / `es.exclude` select nothing the ES mode can move, or something the backend cannot serve."""


class DeviceUnavailable(UsageError, RuntimeError):
    """A device the config names that this machine does not have (a CUDA GPU, or GPU index k)."""


class RunDirError(UsageError):
    """A run directory that cannot be used as asked (exists, in use by another process, finished, bad name)."""
