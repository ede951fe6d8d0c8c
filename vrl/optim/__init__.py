"""Update rules behind the ask/tell contract.

`OPTIMIZERS` is the one list of update rules: `vrl.config` builds the `optimizer` field and one
config section per rule (the class's `Config`) from it, and `make_optimizer` builds the rule a
run names. A new rule is its module plus one line here.
"""

from __future__ import annotations

from importlib import import_module

from vrl.optim.base import Optimizer, Variant

__all__ = ["OPTIMIZERS", "Optimizer", "Variant", "make_optimizer", "optimizer_class"]

OPTIMIZERS: dict[str, str] = {
    "es": "vrl.optim.es:ES",
    "grpo": "vrl.optim.grpo:GRPO",
}


def optimizer_class(name: str) -> type[Optimizer]:
    """The `Optimizer` subclass registered as `name`."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose {' or '.join(map(repr, OPTIMIZERS))}")
    module, attr = OPTIMIZERS[name].split(":")
    return getattr(import_module(module), attr)


def make_optimizer(config) -> Optimizer:
    """The optimizer named by `config.optimizer`, configured from its own section of the config."""
    return optimizer_class(config.optimizer).from_config(config)
