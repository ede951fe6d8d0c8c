"""Update rules behind the ask/tell contract."""

from vrl.optim.base import Optimizer, Variant

__all__ = ["Optimizer", "Variant", "make_optimizer"]


def make_optimizer(config) -> Optimizer:
    """The optimizer named by `config.optimizer`, configured from its sub-section."""
    if config.optimizer == "es":
        from vrl.optim.es import ES

        return ES(config.es, seed=config.seed, base={"model": config.model, "revision": config.generator.revision})
    if config.optimizer == "grpo":
        from vrl.optim.grpo import GRPO

        return GRPO(config.grpo, seed=config.seed, total_iterations=config.iterations)
    raise ValueError(f"unknown optimizer {config.optimizer!r}; choose es or grpo")
