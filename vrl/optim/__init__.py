"""Update rules behind the ask/tell contract.

Update rules are registered by name through the `register_optimizers` hook (vrl's `es` and `grpo`
by `vrl.builtin`, others by plugins): `vrl.config` builds one config section per rule (the class's
`Config`), and `make_optimizer` builds the rule a run names. A new rule is its module plus one
`register(...)` line in its plugin.
"""

from __future__ import annotations

from vrl.optim.base import Optimizer, Variant

__all__ = ["Optimizer", "Variant", "make_optimizer", "optimizer_class", "optimizer_names"]


def optimizer_names() -> list[str]:
    """The registered update rules."""
    from vrl.plugins import registry

    return registry().names("optimizers")


def optimizer_class(name: str) -> type[Optimizer]:
    """The `Optimizer` subclass registered as `name` (`UnknownNameError`: one line listing the rules there are)."""
    from vrl.plugins import registry

    return registry().subclass("optimizers", name, Optimizer, "optimizer")


def make_optimizer(config) -> Optimizer:
    """The optimizer named by `config.optimizer`, configured from its own section of the config."""
    return optimizer_class(config.optimizer).from_config(config)
