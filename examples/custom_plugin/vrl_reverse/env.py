"""Reverse a word: the task, its verifier and its reward."""

from __future__ import annotations

import random
import re

from pydantic import Field

import vrl

WORDS = ["apple", "river", "stone", "vector", "plugin", "reward", "lemma", "proof", "token", "garden"]
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def make_task(task_id: str, word: str) -> vrl.Task:
    prompt = f"Reverse the word '{word}'. Reply with <answer>...</answer>.\n"
    return vrl.Task(id=task_id, prompt=prompt, data={"word": word})


class ReverseVerifier(vrl.SimpleVerifier):
    """Exact match of the reversed word; partial credit for the longest correct prefix."""

    name = "reverse"

    def check(self, attempt: vrl.Attempt) -> vrl.Verdict:
        expected = attempt.task.data["word"][::-1]
        found = ANSWER.findall(attempt.completion.text)
        if not found:
            return vrl.Verdict.fail(vrl.Status.REJECTED, "no <answer>...</answer>")
        answer = found[-1].strip()
        if answer == expected:
            return vrl.Verdict.ok()
        prefix = next((i for i, (a, b) in enumerate(zip(answer, expected)) if a != b), min(len(answer), len(expected)))
        return vrl.Verdict.fail(vrl.Status.FAILED, f"expected {expected!r}, got {answer!r}", score=prefix / len(expected))


class ReverseOptions(vrl.EnvOptions):
    """What `-o KEY=VALUE` may set; anything else, or a value of the wrong type, is a one-line error."""

    size: int = Field(100, ge=1, description="Tasks per split.")
    seed: int = Field(0, description="Seed of the word draw.")


class ReverseEnvironment(vrl.Environment):
    name = "reverse"
    description = "Reverse a word (example plugin)."
    defaults = {"sampling.max_new_tokens": 24}
    Options = ReverseOptions

    def __init__(self, **options):
        o = self.parse_options(options)
        self.size, self.seed = o.size, o.seed

    def tasks(self, split: str = "train", limit: int | None = None) -> list[vrl.Task]:
        self._check_split(split)
        rng = random.Random(f"{self.seed}-{split}")
        n = self.size if limit is None else min(limit, self.size)
        return [make_task(f"{split}-{i}", rng.choice(WORDS)) for i in range(n)]

    def verifier(self) -> vrl.Verifier:
        return ReverseVerifier()

    def shaper(self) -> vrl.RewardShaper:
        return vrl.PartialCredit()

    def task_from_data(self, data: dict) -> vrl.Task:
        if "word" in data and "prompt" not in data:
            return make_task(str(data.get("id", data["word"])), str(data["word"]))
        return super().task_from_data(data)
