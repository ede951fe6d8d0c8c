"""A toy environment a tiny random model can learn: write many characters from a target set.

Score = fraction of completion characters that belong to `TARGET` (partial credit). A random
byte-level model starts near len(TARGET)/256; both ES and GRPO should raise it within a few
iterations, which is what optimizer tests use to show learning.
"""

from __future__ import annotations

from vrl import Attempt, Environment, PartialCredit, SimpleVerifier, Status, Task, Verdict

TARGET = frozenset("abcdefghijklmnop")


class CharsVerifier(SimpleVerifier):
    name = "toy-chars"

    def check(self, attempt: Attempt) -> Verdict:
        text = attempt.completion.text
        if not text:
            return Verdict.fail(Status.FAILED, "empty completion")
        frac = sum(ch in TARGET for ch in text) / len(text)
        if frac == 1.0:
            return Verdict.ok("all characters in the target set")
        return Verdict.fail(Status.FAILED, f"{frac:.0%} of characters in the target set", score=frac)


class CharsEnvironment(Environment):
    name = "toy-chars"
    description = "Write only the letters a-p."
    defaults = {"sampling.max_new_tokens": 16}

    def __init__(self, size: int = 16):
        self.size = size

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        n = self.size if limit is None else min(limit, self.size)
        return [Task(id=f"{split}-{i}", prompt=f"Task {i}: write letters.\n") for i in range(n)]

    def verifier(self) -> CharsVerifier:
        return CharsVerifier()

    def shaper(self) -> PartialCredit:
        return PartialCredit()
