"""Errors the user can fix. The command line prints them as one line and exits with status 2.

Raise a `UsageError` (or a subclass) for anything the person running vrl can act on: a bad option,
a missing file, an unreachable model hub or verifier server, a run directory in use. Its message
says what is wrong and how to fix it, in one line. Anything else is a bug and keeps its traceback
(`vrl -v`).
"""

from __future__ import annotations

import sysconfig
import traceback


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


class PluginError(UsageError, RuntimeError):
    """A plugin's own code is broken: its verifier raised on every attempt of an iteration, or its
    reward shaper raised. The run stops before the update; the message names the plugin, the
    exception and where it was raised."""


def describe(exc: BaseException) -> str:
    """`Type: message (file:line in function)` on one line, for an error message about a plugin's code.

    Call it where the exception is caught. The location is the innermost frame below the catching one
    that is neither Python's standard library nor an installed package: the plugin's own line, not
    pydantic's `__getattr__` or `json/decoder.py`. A plugin installed as a package has no such frame;
    it gets the first frame below the catching one outside the standard library (its entry point,
    `check` say).
    """
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    below = frames[1:] or frames  # frames[0] is the caller's, where the exception was caught
    paths = sysconfig.get_paths()
    stdlib = ("<", paths["stdlib"], paths["platstdlib"])  # "<frozen importlib._bootstrap>" and the like

    def installed(f: traceback.FrameSummary) -> bool:
        return "site-packages" in f.filename or "dist-packages" in f.filename

    def python(f: traceback.FrameSummary) -> bool:
        return f.filename.startswith(stdlib) and not installed(f)  # a venv's site-packages lies under platstdlib

    own = [f for f in below if not python(f) and not installed(f)]
    where = own[-1] if own else next((f for f in below if not python(f)), below[-1] if below else None)
    text = " ".join(str(exc).split())  # one line however the message was wrapped
    if len(text) > 300:
        text = text[:297] + "..."
    at = f" ({where.filename}:{where.lineno} in {where.name})" if where else ""
    return f"{type(exc).__name__}: {text}{at}"


class IntegrityAlarm(UsageError, RuntimeError):
    """The verifier caught an attempt breaking its integrity (a canary false theorem passed): the run
    stops before the update, and the attempts are kept in the run's alarms.jsonl for inspection."""
