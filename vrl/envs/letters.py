"""`letters`: a task the tiny random model learns within a minute on a CPU, to watch vrl learn.

The model is asked to write letters; the verifier scores the share of completion characters that
are in a-p (partial credit), and passes a completion made only of them. A random byte-level model
starts near 16/257 ≈ 0.06; the defaults below (large ES steps on the output layer only, or a large
GRPO learning rate) take it past 0.8 in about ten iterations. Countdown, the default environment,
is a real reasoning task that a random model cannot learn; this one shows the loop working.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vrl.environment import Environment, EnvOptions
from vrl.envs import TINY_MODEL_STEPS
from vrl.reward import PartialCredit
from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import SimpleVerifier

TARGET = frozenset("abcdefghijklmnop")


class LettersVerifier(SimpleVerifier):
    """Score = share of characters in a-p; pass = all of them (a pure function of the text)."""

    name = "letters"

    def check(self, attempt: Attempt) -> Verdict:
        text = attempt.completion.text
        if not text:
            return Verdict.fail(Status.FAILED, "empty completion")
        share = sum(ch in TARGET for ch in text) / len(text)
        if share == 1.0:
            return Verdict.ok("all characters in a-p")
        return Verdict.fail(Status.FAILED, f"{share:.0%} of characters in a-p", score=share)


class LettersOptions(EnvOptions):
    """`-o` options of letters."""

    size: int = Field(16, ge=1, description="Tasks per split.")


class LettersEnvironment(Environment):
    name = "letters"
    description = "Write only the letters a-p: a task the tiny model learns in about ten iterations."
    # Suggested settings for the tiny random model (a pretrained model needs far smaller steps).
    defaults = {
        "tasks_per_iteration": 8,
        "sampling.max_new_tokens": 16,
        **TINY_MODEL_STEPS,
    }

    Options = LettersOptions

    def __init__(self, **options: Any):
        """Options: see `LettersOptions` (`-o size=32`)."""
        self.size = self.parse_options(options).size

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        n = self.size if limit is None else min(limit, self.size)
        return [Task(id=f"{split}-{i}", prompt=f"Task {i}: write letters.\n") for i in range(n)]

    def verifier(self) -> LettersVerifier:
        return LettersVerifier()

    def shaper(self) -> PartialCredit:
        return PartialCredit()
