"""The data that flows through the loop: tasks, completions, verdicts.

All three are pydantic models so they serialise to JSON unchanged, which is what lets them cross
process, sandbox and Modal boundaries and land in run directories.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vrl.errors import UsageError

ChatMessage = dict[str, str]
Prompt = Union[str, list[ChatMessage]]


class Task(BaseModel):
    """One problem: a stable id, the prompt the model sees, and the data the verifier needs."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Stable identifier, unique within an environment split.")
    prompt: Prompt = Field(description="Plain text, or chat messages [{'role': ..., 'content': ...}].")
    data: dict[str, Any] = Field(
        default_factory=dict,
        description="Whatever the verifier needs (target, tests, formal statement...). Never shown to the model.",
    )


def refuse_shared_ids(tasks: Sequence[Task], environment: str, split: str) -> None:
    """Refuse a split where two tasks share an id, naming it: completions are joined to their tasks by id, so
    they would be judged against each other's data."""
    seen: dict[str, int] = {}
    for t in tasks:
        seen[t.id] = seen.get(t.id, 0) + 1
    shared = {i: n for i, n in seen.items() if n > 1}
    if shared:
        task_id, n = next(iter(shared.items()))
        raise UsageError(f"environment {environment!r}, split {split!r}: {len(shared)} task id(s) are used by more than "
                         f"one task (e.g. {task_id!r}, {n} times); completions are matched to tasks by id, so each "
                         "task needs an id of its own")


class Turn(BaseModel):
    """One turn of an episode as the run's samples show it: the model's text or the environment's answer."""

    role: str = Field(description="'assistant' (the model), 'user' (the environment's message) or 'tool' (a tool's result).")
    content: str
    tokens: int = Field(0, description="Token ids this turn added to the trajectory.")
    name: str | None = Field(None, description="The tool's name, for a tool result.")
    seconds: float = Field(0.0, description="Wall-clock seconds of the environment step that wrote it.")
    passed: bool | None = Field(None, description="The environment's verdict on the model turn it answers, if it gives one.")


class Episode(BaseModel):
    """A multi-turn attempt beyond its prompt: every turn, the environment's reward (if it keeps one), counters."""

    turns: list[Turn] = Field(default_factory=list)
    reward: float | None = Field(None, description="The reward the environment computed at the end (TRL's "
                                 "`get_reward`), for its verifier; None when the verifier judges the text.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Per-episode counters: tool_calls, "
                                      "tool_errors, step_errors, env_step_s, model_tokens, env_tokens.")
    prompt: Prompt | None = Field(None, description="The episode's first prompt where the environment changed the "
                                  "task's (a TRL environment class's reset() text appended), as reward functions get "
                                  "it in `prompts` (TRL's); None: the task's own.")

    def model_turns(self) -> list[str]:
        """The model's turns, in order."""
        return [t.content for t in self.turns if t.role == "assistant"]


class Completion(BaseModel):
    """One attempt at a task by one policy variant."""

    task_id: str
    text: str
    variant: int = Field(0, description="Index of the policy variant (ES member, or 0 for GRPO) that produced it.")
    sample: int = Field(0, description="Index of this sample among the n drawn for the same task and variant.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = Field("stop", description="'stop' (EOS or a stop string) or 'length' (hit max_new_tokens).")
    # Token ids as sampled, kept so GRPO trains on exactly what was generated (no re-tokenisation drift).
    prompt_token_ids: list[int] | None = Field(None, exclude=True, repr=False)
    token_ids: list[int] | None = Field(None, exclude=True, repr=False)
    logprobs: list[float] | None = Field(None, exclude=True, repr=False)
    # Episodes: 1 for each token of `token_ids` the model sampled, 0 for the environment's (feedback, tool
    # results), which GRPO masks out of the loss as TRL masks tool results. None: every token is the model's.
    token_mask: list[int] | None = Field(None, exclude=True, repr=False)
    episode: Episode | None = Field(None, description="The whole conversation of a multi-turn attempt (`text` is "
                                    "then its last model turn); None for a single turn.")
    weights_version: int | None = Field(
        None, description="Updates published to the sampler when the pass that made it started (asynchronous "
        "GRPO, grpo.max_staleness > 0); None when the loop is synchronous.",
    )


class Status(str, Enum):
    """Why a verdict is what it is."""

    PASSED = "passed"
    FAILED = "failed"  # checked and wrong
    TIMEOUT = "timeout"  # ran out of wall-clock or compute budget
    CRASHED = "crashed"  # the attempt (or the checker on its behalf) died
    REJECTED = "rejected"  # refused before running: malformed, banned construct, no answer found


class Verdict(BaseModel):
    """A verifier's answer for one attempt. Bad attempts produce verdicts, never exceptions."""

    passed: bool
    score: float = Field(description="In [0, 1]; 1.0 for a pass, partial credit otherwise.")
    status: Status
    detail: str = Field("", description="Human-readable reason, e.g. which test failed or which construct was banned.")
    elapsed_s: float = 0.0
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The verifier's own counters for this attempt (e.g. `lean/rechecks`); the trainer sums them "
        "per iteration into metrics.jsonl (see `Environment.iteration_metrics` for derived rates).",
    )
    rewards: list[tuple[float | None, float]] | None = Field(
        None,
        description="(value, weight) of each reward function, in their order, when the verdict comes from reward "
        "functions (`vrl.reward_functions`); value None: the function does not apply. A verdict whose every value "
        "is None is unscorable: GRPO leaves it out of its group's baseline and gives it advantage 0, as TRL does.",
    )
    alarm: str | None = Field(
        None,
        description="Set when the verifier found its own integrity breached while judging this attempt (a canary "
        "false theorem passed): the run keeps the attempt in alarms.jsonl and stops before the update.",
    )

    @field_validator("score")
    @classmethod
    def _score_in_unit_interval(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"score must lie in [0, 1], got {v}")
        return v

    @classmethod
    def ok(cls, detail: str = "", elapsed_s: float = 0.0) -> Verdict:
        return cls(passed=True, score=1.0, status=Status.PASSED, detail=detail, elapsed_s=elapsed_s)

    @classmethod
    def fail(cls, status: Status | str, detail: str, score: float = 0.0, elapsed_s: float = 0.0) -> Verdict:
        status = Status(status)
        if status is Status.PASSED:
            raise ValueError("use Verdict.ok for a pass")
        return cls(passed=False, score=score, status=status, detail=detail, elapsed_s=elapsed_s)


class Attempt(BaseModel):
    """What a verifier judges: the task (with its trusted data) and the completion text."""

    task: Task
    completion: Completion


class Verified(list):  # list[Completion]
    """A batch of completions that arrives already judged, by the same verifier where it was sampled (a rank
    > 0 of a torchrun launch verifies its own share): `verdicts[i]` is the verdict of `self[i]`, and
    `busy_s` the verifier's busy seconds on them there. The loop takes the verdicts as they are instead of
    verifying again; whoever reads only the completions sees a plain batch."""

    def __init__(self, completions: Sequence[Completion] = (), verdicts: Sequence[Verdict] = (), busy_s: float = 0.0):
        super().__init__(completions)
        if len(verdicts) != len(self):
            raise ValueError(f"{len(verdicts)} verdicts for {len(self)} completions")
        self.verdicts, self.busy_s = list(verdicts), busy_s


class Result(BaseModel):
    """A judged attempt with its shaped reward: what the optimizer's `tell` receives."""

    task: Task
    completion: Completion
    verdict: Verdict
    reward: float
