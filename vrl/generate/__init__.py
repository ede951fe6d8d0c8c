"""Generators: turn tasks into completions for one policy variant."""

from vrl.generate.base import Generator

__all__ = ["Generator", "make_generator"]


def make_generator(config, needs=None):
    """Build the generator the run's config asks for (imports the backend lazily).

    `needs`: what the update rule will ask of it (`vrl.policy.HostNeeds`; None: sampling only).
    """
    backend = config.generator.backend
    if backend == "hf":
        from vrl.generate.hf import HFGenerator

        return HFGenerator.from_config(config)
    if backend == "vllm":
        from vrl.generate.vllm import VLLMGenerator

        return VLLMGenerator.from_config(config, needs)
    raise ValueError(f"unknown generator backend {backend!r}; choose hf or vllm")
