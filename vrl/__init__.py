"""vrl: verifier-backed reinforcement learning for language models.

The public API: the data types, the interfaces a plugin implements, the hook markers, and the
trainer that runs the fixed loop.
"""

from vrl.config import TrainConfig
from vrl.environment import Environment, EnvOptions
from vrl.errors import UsageError
from vrl.generate.base import Generator
from vrl.hookspecs import hookimpl
from vrl.optim.base import Optimizer, Variant
from vrl.reward import Binary, FormatBonus, LengthPenalty, PartialCredit, RewardShaper, Weighted
from vrl.runtime.base import Runtime
from vrl.trainer import Trainer
from vrl.types import Attempt, Completion, Result, Status, Task, Verdict
from vrl.verifier import SimpleVerifier, Verifier, VerifierUnavailable

__all__ = [
    "Attempt",
    "Binary",
    "Completion",
    "EnvOptions",
    "Environment",
    "FormatBonus",
    "Generator",
    "LengthPenalty",
    "Optimizer",
    "PartialCredit",
    "Result",
    "RewardShaper",
    "Runtime",
    "SimpleVerifier",
    "Status",
    "Task",
    "TrainConfig",
    "Trainer",
    "UsageError",
    "Variant",
    "Verdict",
    "Verifier",
    "VerifierUnavailable",
    "Weighted",
    "hookimpl",
]
