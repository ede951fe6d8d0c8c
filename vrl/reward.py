"""Reward shaping: (task, completion, verdict) -> float, composable with weights.

    shaper = Binary() + 0.1 * FormatBonus(r"<answer>.*</answer>") - 0.001 * LengthPenalty()

builds a `Weighted` shaper; weights multiply, `+` concatenates terms.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

from vrl.types import Completion, Task, Verdict
from vrl.verifier import is_verifier_error


def judged(verdict: Verdict) -> bool:
    """Whether the verifier judged the attempt. Not so for a verifier error (its own failure: a reward function or
    LLM judge that raised, hung or answered malformed on it): the shaped reward of such a verdict is a stand-in,
    never a score, so GRPO treats it as unscorable (NaN, as TRL treats None) and ES leaves it out of its
    member's fitness."""
    return not is_verifier_error(verdict)


class RewardShaper(ABC):
    """Turns a verdict into a scalar reward."""

    @abstractmethod
    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float: ...

    def __add__(self, other: RewardShaper) -> Weighted:
        return Weighted(_terms(self) + _terms(other))

    def __sub__(self, other: RewardShaper) -> Weighted:
        return Weighted(_terms(self) + [(s, -w) for s, w in _terms(other)])

    def __mul__(self, weight: float) -> Weighted:
        return Weighted([(s, w * float(weight)) for s, w in _terms(self)])

    __rmul__ = __mul__

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _terms(shaper: RewardShaper) -> list[tuple[RewardShaper, float]]:
    return list(shaper.terms) if isinstance(shaper, Weighted) else [(shaper, 1.0)]


class Weighted(RewardShaper):
    """A weighted sum of shapers."""

    def __init__(self, terms: list[tuple[RewardShaper, float]]):
        if not terms:
            raise ValueError("Weighted needs at least one (shaper, weight) term")
        self.terms = terms

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        return sum(w * s(task, completion, verdict) for s, w in self.terms)


class Binary(RewardShaper):
    """1.0 for a pass, 0.0 otherwise."""

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        return 1.0 if verdict.passed else 0.0


class PartialCredit(RewardShaper):
    """The verdict's score in [0, 1] (e.g. the fraction of tests passed)."""

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        return float(verdict.score)


class LengthPenalty(RewardShaper):
    """Completion length as a fraction of `max_tokens` (weight it negatively), capped at 1."""

    def __init__(self, max_tokens: int = 1024):
        if max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        self.max_tokens = max_tokens

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        return min(1.0, completion.completion_tokens / self.max_tokens)


class FormatBonus(RewardShaper):
    """1.0 when the completion matches `pattern` (searched, DOTALL), else 0.0."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._regex = re.compile(pattern, re.DOTALL)

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        return 1.0 if self._regex.search(completion.text) else 0.0
