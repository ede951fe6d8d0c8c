"""Where generation and verification run. The trainer only sees the `Runtime` interface.

`RUNTIMES` is the one list of runtimes (`runtime.kind`): each names a callable that builds the
runtime from a run's config. A new runtime is its module plus one line here.
"""

from __future__ import annotations

from importlib import import_module

from vrl.runtime.base import Runtime, VerificationPool

__all__ = ["RUNTIMES", "Runtime", "VerificationPool", "make_runtime"]

RUNTIMES: dict[str, str] = {
    "local": "vrl.runtime.local:LocalRuntime",
    "modal": "vrl.runtime.modal.launch:modal_runtime",
}


def make_runtime(config) -> Runtime:
    """The runtime `config.runtime.kind` names, built from the config."""
    kind = config.runtime.kind
    if kind not in RUNTIMES:
        raise ValueError(f"unknown runtime {kind!r}; choose {' or '.join(map(repr, RUNTIMES))}")
    module, attr = RUNTIMES[kind].split(":")
    return getattr(import_module(module), attr)(config)
