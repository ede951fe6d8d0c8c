"""Repair episodes: the environment's own verifier judges every turn, and a failure's report goes back.

A prover repairs a proof from the compiler's errors, a coder a function from the failing test's output.
`Repair` is the interaction for that: each model turn goes through the environment's verifier — the
whole pipeline, integrity checks included, exactly as a final attempt does — and a failed turn gets the
verdict's report back (an environment may format it, e.g. add the failing line), trimmed to a budget,
until a turn passes or `max_turns` is reached. The episode's verdict is the verifier's on the last turn:
the one this interaction already got (`Reply.verdict`), which the run's verification pool takes as it is
(`vrl.episodes.judged_verdict`) rather than judging the same text again (for Lean, a second compile and
re-check). It is a verdict of the whole pipeline, canaries included, so the run's alarms and verifier
counters see every pass as before; an episode whose last step failed (no verdict) is judged by the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vrl.episodes import Interaction, ModelTurn, Reply
from vrl.types import Attempt, Completion, Task, Verdict

#: Characters of a failure report sent back to the model, unless the environment gives another budget.
FEEDBACK_CHARS = 1200

Feedback = Callable[[Task, str, Verdict], str]


def default_feedback(task: Task, text: str, verdict: Verdict) -> str:
    return f"That attempt failed ({verdict.status.value}): {verdict.detail}\nFix it and give the whole answer again."


def trim(text: str, budget: int) -> str:
    """`text` cut to `budget` characters, saying how much was left out."""
    if len(text) <= budget:
        return text
    note = f"\n[... {len(text) - budget} more characters]"
    return text[: max(0, budget - len(note))] + note


class SharedVerifier:
    """One verifier per event loop, made on first use (a verifier's clients belong to the loop they run on),
    shared by every repair episode of an environment."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self._by_loop: dict[int, Any] = {}

    def get(self) -> Any:
        loop = id(asyncio.get_running_loop())
        if loop not in self._by_loop:
            self._by_loop[loop] = self.make()
        return self._by_loop[loop]


class Repair(Interaction):
    """A turn that fails the verifier gets its report back; a turn that passes ends the episode."""

    def __init__(self, task: Task, verifier: SharedVerifier, max_turns: int, feedback: Feedback = default_feedback,
                 budget: int = FEEDBACK_CHARS):
        self.task, self.verifier, self.max_turns = task, verifier, max_turns
        self.feedback, self.budget = feedback, budget

    async def reply(self, turn: ModelTurn) -> Reply:
        attempt = Attempt(task=self.task, completion=Completion(task_id=self.task.id, text=turn.text))
        [verdict] = await self.verifier.get().verify([attempt])
        if verdict.passed or verdict.alarm or turn.last:  # the episode's verdict (an alarm stops the run there)
            return Reply(done=True, passed=verdict.passed, verdict=verdict)
        report = trim(self.feedback(self.task, turn.text, verdict), self.budget)
        return Reply(messages=[{"role": "user", "content": report}], passed=False, verdict=verdict)


class RepairEpisodes:
    """Mixin for an `Environment` with a `turns` option: with `turns` > 1 its episodes are repairs, each turn
    judged by the environment's own `verifier()` (one per event loop), the report written by `feedback`.
    Put it before `Environment` in the bases and set `turns` and `feedback_chars` in `__init__`."""

    turns: int = 1
    feedback_chars: int = FEEDBACK_CHARS
    feedback: Feedback = staticmethod(default_feedback)
    _repair_verifier: SharedVerifier | None = None

    @property
    def multi_turn(self) -> bool:
        return self.turns > 1

    def interaction(self, task: Task) -> Repair | None:
        if self.turns == 1:
            return None
        if self._repair_verifier is None:
            self._repair_verifier = SharedVerifier(self.verifier)  # type: ignore[attr-defined]
        return Repair(task, self._repair_verifier, self.turns, type(self).feedback, self.feedback_chars)
