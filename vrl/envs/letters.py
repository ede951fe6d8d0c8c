"""`letters`: a task the tiny random model learns within a minute on a CPU, to watch vrl learn.

The model is asked to write letters; the verifier scores the share of completion characters that
are in a-p (partial credit), and passes a completion made only of them. A random byte-level model
starts near 16/257 ≈ 0.06; the defaults below (large ES steps on the output layer only, or a large
GRPO learning rate) take it past 0.8 in about ten iterations. Countdown, the default environment,
is a real reasoning task that a random model cannot learn; this one shows the loop working.

`-o mix=true` makes it a stand-in for a prover's data (lean_workbook: a given model always or never
proves most statements) under a binary reward, to measure dynamic sampling and the pass-rate curriculum
on a CPU (`benchmarks/curriculum_letters.py`). Task i's kind is `KINDS[i % 4]` (in `Task.data`):
`sometimes` (i % 4 == 0) passes when at least `SOMETIMES_SHARE` of its characters are in a-p (the random
model: about a quarter of its 16-token completions; learnable), `always` passes every completion and
`never` (i % 4 in 2, 3) none, whatever the model writes. The reward is the pass (`Binary`), and each
`sometimes` attempt counts in `letters/sometimes_attempts` and `letters/sometimes_passed`, whose ratio is
the iteration's `letters/sometimes_pass_rate`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vrl.environment import Environment, EnvOptions
from vrl.envs import TINY_MODEL_STEPS
from vrl.reward import Binary, PartialCredit
from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import SimpleVerifier

TARGET = frozenset("abcdefghijklmnop")
KINDS = ("sometimes", "always", "never", "never")
"""The kind of task i under `-o mix=true`: `KINDS[i % 4]` (1 sometimes-, 1 always-, 2 never-solved in 4)."""
SOMETIMES_SHARE = 0.125
"""A `sometimes` task passes when at least this share of the completion's characters are in a-p."""


class LettersVerifier(SimpleVerifier):
    """Score = share of characters in a-p; pass = all of them (a pure function of the text)."""

    name = "letters"

    def check(self, attempt: Attempt) -> Verdict:
        text = attempt.completion.text
        kind = attempt.task.data.get("kind")
        if kind is not None:  # -o mix=true
            return self._mixed(kind, text)
        if not text:
            return Verdict.fail(Status.FAILED, "empty completion")
        share = sum(ch in TARGET for ch in text) / len(text)
        if share == 1.0:
            return Verdict.ok("all characters in a-p")
        return Verdict.fail(Status.FAILED, f"{share:.0%} of characters in a-p", score=share)

    @staticmethod
    def _mixed(kind: str, text: str) -> Verdict:
        """`-o mix=true`: a pass or a fail (score 1 or 0) by the task's kind; see the module docstring."""
        if kind == "always":
            return Verdict.ok("an always-solved task")
        if kind == "never":
            return Verdict.fail(Status.FAILED, "a never-solved task")
        if kind != "sometimes":
            raise ValueError(f"letters: unknown task kind {kind!r}; expected one of {sorted(set(KINDS))}")
        share = sum(ch in TARGET for ch in text) / len(text) if text else 0.0
        verdict = Verdict.ok(f"{share:.0%} of characters in a-p") if share >= SOMETIMES_SHARE else \
            Verdict.fail(Status.FAILED, f"{share:.0%} of characters in a-p, under {SOMETIMES_SHARE:.1%}")
        return verdict.model_copy(update={"metrics": {"letters/sometimes_attempts": 1.0,
                                                      "letters/sometimes_passed": float(verdict.passed)}})


class LettersOptions(EnvOptions):
    """`-o` options of letters."""

    size: int = Field(16, ge=1, description="Tasks per split.")
    mix: bool = Field(False, description="A prover-like mix under a binary reward: of every 4 tasks one sometimes "
                      "solved (at least 1/8 of the characters in a-p), one always and two never solved.")


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
        """Options: see `LettersOptions` (`-o size=32`, `-o mix=true`)."""
        parsed = self.parse_options(options)
        self.size, self.mix = parsed.size, parsed.mix

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        n = self.size if limit is None else min(limit, self.size)
        return [Task(id=f"{split}-{i}", prompt=f"Task {i}: write letters.\n",
                     data={"kind": KINDS[i % len(KINDS)]} if self.mix else {}) for i in range(n)]

    def verifier(self) -> LettersVerifier:
        return LettersVerifier()

    def shaper(self) -> PartialCredit | Binary:
        return Binary() if self.mix else PartialCredit()

    def iteration_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out = dict(sums)
        if sums.get("letters/sometimes_attempts"):
            out["letters/sometimes_pass_rate"] = sums["letters/sometimes_passed"] / sums["letters/sometimes_attempts"]
        return out
