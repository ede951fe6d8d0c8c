"""A pass-rate curriculum: retire the tasks the policy always or never solves, re-admit a few.

Each time a task is drawn, its observation is the share of its attempts that passed (the raw verdicts,
never the shaped reward): a GRPO group's G samples, or ES's N members. Its estimated pass rate is the
last observation, an exponential moving average, or the maximum (`curriculum.estimator`). Once a task has
`min_observations` observations, an estimate at or below `band_low` retires it as too hard and one at or
above `band_high` as too easy; a retired task is drawn again, when its turn in the schedule comes, with
probability `readmit_prob` (a seeded coin per turn, `vrl.schedule`), and its next observation decides
again. A task whose row a verifier found defective (a verdict metric named `*/defective*` > 0, e.g. Lean's
`lean/defective_statement`) is retired at once and never re-admitted.

The state is a fold over the rows of `tasks.jsonl` (`observe`), so a resume rebuilds it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vrl.types import Verdict


def defective(verdict: Verdict) -> bool:
    """Whether a verdict says the task itself is broken: a metric `<plugin>/defective...` above 0."""
    return any(key.rsplit("/", 1)[-1].startswith("defective") and value > 0 for key, value in verdict.metrics.items())


@dataclass
class TaskRecord:
    observations: int = 0
    estimate: float = 0.0
    defective: bool = False


@dataclass
class Curriculum:
    """The pass-rate state of every task drawn so far (`config`: a `vrl.config.CurriculumConfig`)."""

    config: Any
    tasks: dict[str, TaskRecord] = field(default_factory=dict)

    def observe(self, task_id: str, rate: float, is_defective: bool = False) -> None:
        """Fold one observation (a pass rate) of a task into its estimate."""
        c, rec = self.config, self.tasks.setdefault(task_id, TaskRecord())
        if rec.observations == 0 or c.estimator == "last":
            rec.estimate = rate
        elif c.estimator == "ema":
            rec.estimate = c.ema_weight * rate + (1.0 - c.ema_weight) * rec.estimate
        elif c.estimator == "max":
            rec.estimate = max(rec.estimate, rate)
        else:
            raise ValueError(f"curriculum.estimator={c.estimator!r}; choose last, ema or max")
        rec.observations += 1
        rec.defective = rec.defective or is_defective

    def status(self, task_id: str) -> str:
        """'active', 'retired_low' (too hard), 'retired_high' (too easy) or 'retired_defective'."""
        rec = self.tasks.get(task_id)
        if rec is None:
            return "active"
        if rec.defective:
            return "retired_defective"
        if rec.observations < self.config.min_observations:
            return "active"
        if rec.estimate <= self.config.band_low:
            return "retired_low"
        if rec.estimate >= self.config.band_high:
            return "retired_high"
        return "active"

    def retired(self, task_id: str) -> bool:
        return self.status(task_id) != "active"

    def counts(self, pool_ids: list[str]) -> dict[str, float]:
        """`curriculum/*` counts over the task pool."""
        out = {"curriculum/active": 0.0, "curriculum/retired_low": 0.0, "curriculum/retired_high": 0.0,
               "curriculum/retired_defective": 0.0}
        for tid in pool_ids:
            out[f"curriculum/{self.status(tid)}"] += 1
        return out
