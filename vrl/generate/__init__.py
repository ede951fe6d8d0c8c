"""Generators: turn tasks into completions for one policy variant.

Backends are registered by name through the `register_generators` hook (`hf` and `vllm` by
`vrl.builtin`); `generator.backend` picks one and `generator.<backend>` holds its settings (the
class's `Config`). A new backend is its module plus one `register(...)` line in its plugin.
"""

from __future__ import annotations

from vrl.generate.base import Generator

__all__ = ["Generator", "generator_class", "make_generator"]


def generator_class(name: str) -> type[Generator]:
    """The `Generator` subclass registered as backend `name` (`UnknownNameError`: one line listing them)."""
    from vrl.plugins import registry

    return registry().subclass("generators", name, Generator, "generator backend")


def make_generator(config, needs=None) -> Generator:
    """One engine of the backend the run's config names (its module is imported when registered).

    `needs`: what the update rule will ask of it (`vrl.policy.HostNeeds`; None: sampling only).
    """
    return generator_class(config.generator.backend).from_config(config, needs)
