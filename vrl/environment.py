"""The Environment: what a plugin registers to make `vrl train --plugin NAME` work.

An environment owns a task source (with splits), prompt formatting (tasks carry their prompts),
its verifier, its reward shaper, and defaults for the run (model, sampling, optimizer settings).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from vrl.reward import Binary, RewardShaper
from vrl.types import Task
from vrl.verifier import Verifier


class Environment(ABC):
    """A concrete world to train in. Subclass it and register a factory from a plugin hook."""

    name: str = "environment"
    description: str = ""
    splits: tuple[str, ...] = ("train", "test")
    #: Config overrides this environment suggests, as dotted keys (`{"sampling.temperature": 0.6}`).
    #: They sit below the user's config file and command line.
    defaults: dict[str, Any] = {}

    @abstractmethod
    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        """The tasks of a split, in a stable order; at most `limit` of them."""

    @abstractmethod
    def verifier(self) -> Verifier:
        """A fresh verifier for this environment's tasks."""

    def shaper(self) -> RewardShaper:
        """How verdicts become rewards. Default: 1 for a pass, 0 otherwise."""
        return Binary()

    def task_from_data(self, data: dict[str, Any]) -> Task:
        """Build a task from inline JSON (used by `vrl verify` lines that carry their own task).

        The default accepts the fields of `Task` directly; environments may accept friendlier forms.
        """
        return Task.model_validate(data)

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(f"environment {self.name!r} has no split {split!r}; splits: {', '.join(self.splits)}")
