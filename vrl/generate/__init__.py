"""Generators: turn tasks into completions for one policy variant."""

from vrl.generate.base import Generator

__all__ = ["Generator", "make_generator"]


def make_generator(config, moves=None):
    """Build the generator the run's config asks for (imports the backend lazily).

    `moves`: how the update rule will change its weights (`vrl.policy.Moves`; None: sampling only).
    """
    backend = config.generator.backend
    if backend == "hf":
        from vrl.generate.hf import HFGenerator

        return HFGenerator.from_config(config)
    if backend == "vllm":
        from vrl.generate.vllm import VLLMGenerator

        return VLLMGenerator.from_config(config, moves)
    raise ValueError(f"unknown generator backend {backend!r}; choose hf or vllm")
