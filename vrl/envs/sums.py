"""`sums`: add numbers, with the difficulty as a parameter: a task graded to a small real model.

Countdown is beyond a 135M model and `letters` is a toy for random weights; RL needs a task the model
solves sometimes, so that the rewards of its attempts differ. Here the difficulty is two options:
`digits` (each operand has exactly that many digits) and `terms` (how many operands). At the default
level (two terms of one digit, prompts in chat form, sampled at temperature 0.7)
SmolLM2-135M-Instruct passes between 10 % and 60 % of the tasks (docs/benchmarks.md,
"SmolLM2-135M-Instruct on sums", says what was measured); `-o digits=2` is harder, `-o terms=3` harder still.

The answer is the last integer in the completion ("3 + 5 = 8" answers 8; commas between digit groups
are read as part of the number), so the model may answer in its own words; the verdict is exact
integer equality. Problems are drawn from a seed, per split, with no download.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from vrl.environment import Environment, EnvOptions
from vrl.reward import Binary, RewardShaper
from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import SimpleVerifier

PROMPT = "What is {expression}? Answer with the number only."
INTEGER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
MAX_DIGITS = 12
_SPLIT_OFFSET = {"train": 0, "test": 1_000_003}


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators allowed), or None."""
    found = INTEGER_RE.findall(text)
    return int(found[-1].replace(",", "")) if found else None


class SumsVerifier(SimpleVerifier):
    """Pass when the completion's last integer is the sum (a pure function of the text)."""

    name = "sums"

    def check(self, attempt: Attempt) -> Verdict:
        answer, expected = last_integer(attempt.completion.text), attempt.task.data["answer"]
        if answer is None:
            return Verdict.fail(Status.REJECTED, "no integer in the completion")
        if answer != expected:
            return Verdict.fail(Status.FAILED, f"answered {answer}, not {expected}")
        return Verdict.ok(f"answered {expected}")


class SumsOptions(EnvOptions):
    """`-o` options of sums."""

    digits: int = Field(1, ge=1, le=MAX_DIGITS, description="Digits of each operand (1: 0-9, 2: 10-99, ...): the difficulty.")
    terms: int = Field(2, ge=2, le=10, description="Operands per problem.")
    size: int = Field(500, ge=1, description="Problems per split.")
    seed: int = Field(0, description="Seed of the problem generator (each split has its own stream).")


class SumsEnvironment(Environment):
    name = "sums"
    description = "Add numbers; -o digits=N / terms=N set the difficulty (default: a small real model's level)."
    splits = ("train", "test")
    # Short answers; a temperature that leaves a 135M model both right and wrong answers to learn from.
    defaults = {"sampling.max_new_tokens": 16, "sampling.temperature": 0.7}
    Options = SumsOptions

    def __init__(self, **options: Any):
        """Options: see `SumsOptions` (`-o digits=2 -o terms=3`)."""
        o = self.parse_options(options)
        self.digits, self.terms, self.size, self.seed = o.digits, o.terms, o.size, o.seed

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        count = self.size if limit is None else min(limit, self.size)
        return [self.task(split, i) for i in range(count)]

    def task(self, split: str, index: int) -> Task:
        rng = random.Random(f"sums:{self.seed}:{_SPLIT_OFFSET[split]}:{self.digits}:{self.terms}:{index}")
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        numbers = [rng.randint(low, 10**self.digits - 1) for _ in range(self.terms)]
        return make_task(f"{split}-{index}", numbers)

    def verifier(self) -> SumsVerifier:
        return SumsVerifier()

    def shaper(self) -> RewardShaper:
        return Binary()

    def task_from_data(self, data: dict[str, Any]) -> Task:
        if "numbers" in data and "prompt" not in data:
            return make_task(str(data.get("id", "inline")), [int(n) for n in data["numbers"]])
        return super().task_from_data(data)


def make_task(task_id: str, numbers: list[int]) -> Task:
    expression = " + ".join(str(n) for n in numbers)
    return Task(id=task_id, prompt=[{"role": "user", "content": PROMPT.format(expression=expression)}],
                data={"numbers": numbers, "answer": sum(numbers)})
