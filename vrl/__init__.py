"""vrl: verifier-backed reinforcement learning for language models.

The public API: the data types, the interfaces a plugin implements, the hook markers, and the
trainer that runs the fixed loop.

Each name is imported from its module on first use (PEP 562), so `import vrl` and `vrl --help`
load neither torch nor the modules behind the names a program does not touch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "Attempt": "vrl.types",
    "Binary": "vrl.reward",
    "Completion": "vrl.types",
    "DatasetEnvironment": "vrl.envs.dataset",
    "EnvOptions": "vrl.environment",
    "Environment": "vrl.environment",
    "FormatBonus": "vrl.reward",
    "Generator": "vrl.generate.base",
    "LengthPenalty": "vrl.reward",
    "Optimizer": "vrl.optim.base",
    "PartialCredit": "vrl.reward",
    "Result": "vrl.types",
    "RewardFunctions": "vrl.reward_functions",
    "RewardShaper": "vrl.reward",
    "Runtime": "vrl.runtime.base",
    "SandboxSpec": "vrl.environment",
    "SimpleVerifier": "vrl.verifier",
    "Status": "vrl.types",
    "Task": "vrl.types",
    "TrainConfig": "vrl.config",
    "resolve_config": "vrl.config",
    "Trainer": "vrl.trainer",
    "UsageError": "vrl.errors",
    "Variant": "vrl.optim.base",
    "Verdict": "vrl.types",
    "Verifier": "vrl.verifier",
    "VerifierUnavailable": "vrl.verifier",
    "Weighted": "vrl.reward",
    "hookimpl": "vrl.hookspecs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vrl' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    if name not in _BUILT_PER_REGISTRY:
        globals()[name] = value  # later lookups skip this function
    return value


# Built from the installed plugins on each use (`vrl.config.TrainConfig`): never cached here, so it
# stays the class of the current plugin registry.
_BUILT_PER_REGISTRY = frozenset({"TrainConfig"})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names (tests/test_import_light.py checks both lists agree)
    from vrl.config import TrainConfig, resolve_config  # noqa: F401
    from vrl.environment import Environment, EnvOptions, SandboxSpec  # noqa: F401
    from vrl.envs.dataset import DatasetEnvironment  # noqa: F401
    from vrl.errors import UsageError  # noqa: F401
    from vrl.generate.base import Generator  # noqa: F401
    from vrl.hookspecs import hookimpl  # noqa: F401
    from vrl.optim.base import Optimizer, Variant  # noqa: F401
    from vrl.reward import Binary, FormatBonus, LengthPenalty, PartialCredit, RewardShaper, Weighted  # noqa: F401
    from vrl.reward_functions import RewardFunctions  # noqa: F401
    from vrl.runtime.base import Runtime  # noqa: F401
    from vrl.trainer import Trainer  # noqa: F401
    from vrl.types import Attempt, Completion, Result, Status, Task, Verdict  # noqa: F401
    from vrl.verifier import SimpleVerifier, Verifier, VerifierUnavailable  # noqa: F401
