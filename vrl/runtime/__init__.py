"""Where generation and verification run. The trainer only sees the `Runtime` interface.

Runtimes are registered by name through the `register_runtimes` hook (`local` and `modal` by
`vrl.builtin`); `runtime.kind` picks one and `runtime.<kind>` holds its settings (the class's
`Config`). A new runtime is its module plus one `register(...)` line in its plugin.
"""

from __future__ import annotations

from vrl.runtime.base import Runtime, VerificationPool

__all__ = ["Runtime", "VerificationPool", "make_runtime", "runtime_class"]


def runtime_class(name: str) -> type[Runtime]:
    """The `Runtime` subclass registered as `name` (`UnknownNameError`: one line listing the runtimes there are)."""
    from vrl.plugins import registry

    return registry().subclass("runtimes", name, Runtime, "runtime")


def make_runtime(config) -> Runtime:
    """The runtime `config.runtime.kind` names, built from the config."""
    return runtime_class(config.runtime.kind).from_config(config)
