"""Dynamic sampling (DAPO): which groups of an iteration teach a group-relative rule, decided whole.

A rule that learns from each task's group of samples relative to the group (`Optimizer.group_relative`:
GRPO) gets a zero advantage from a group whose samples all had the same outcome: it costs generation,
verification and a backward pass and teaches nothing. With `grpo.filter_groups` the loop (`vrl.schedule`)
keeps drawing generation batches and trains on the first `tasks_per_iteration` groups, in schedule order,
whose raw outcome differs between samples.

What is decided here, and what it avoids (the peers' known bugs):

- a group is kept or dropped **whole**, from all its attempts (never a per-row mask, which turns
  [1, 0, 0, 0] into [0, 0, 0, 0]);
- the outcome is the verifier's raw one, `passed` by default, or its `score`; the shaped reward only when
  asked (`reward`), since a format or length bonus makes an all-wrong group look informative;
- scores and rewards are compared with a float64 tolerance (`TOLERANCE`), so 0.1 + 0.2 equals 0.3;
- the kept groups are `Result` objects, so completions, tokens, verdicts and rewards stay aligned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from vrl.types import Result

Kind = Literal["mixed", "all_pass", "all_fail", "constant"]
TOLERANCE = 1e-9
"""Two scores (or rewards) within this (absolute, and relative to the larger) count as equal."""


def outcome(result: Result, metric: str) -> float:
    """A result's outcome under `grpo.filter_groups_metric`: 1.0/0.0 for `passed`, else the score or reward."""
    if metric == "passed":
        return 1.0 if result.verdict.passed else 0.0
    if metric == "score":
        return float(result.verdict.score)
    if metric == "reward":
        return float(result.reward)
    raise ValueError(f"grpo.filter_groups_metric={metric!r}; choose passed, score or reward")


def same(a: float, b: float) -> bool:
    """Equal up to float64 noise (`TOLERANCE`)."""
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def classify(group: Sequence[Result], metric: str) -> Kind:
    """Whether a task's group teaches (`mixed`: the outcome differs between its attempts) or not, and why not:
    every attempt passed (`all_pass`), none did (`all_fail`), or they passed unevenly but the metric (a score,
    a reward) is equal anyway (`constant`). NaN outcomes (an unscorable reward) are left out."""
    values = [v for v in (outcome(r, metric) for r in group) if not math.isnan(v)]
    if len(values) >= 2 and not same(min(values), max(values)):
        return "mixed"
    passed = [r.verdict.passed for r in group]
    if all(passed):
        return "all_pass"
    if not any(passed):
        return "all_fail"
    return "constant"


def by_task(results: Sequence[Result]) -> dict[str, list[Result]]:
    """The results of each task id, in the order they came (a task's group, every variant and sample)."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.task.id, []).append(r)
    return groups


def pass_rate(group: Sequence[Result]) -> float:
    """The share of a group's attempts that passed (the curriculum's observation; 0 for an empty group)."""
    return sum(r.verdict.passed for r in group) / len(group) if group else 0.0
