"""The python-tests environment: write a Python function that passes hidden tests in a sandbox."""

from __future__ import annotations

from typing import Any

from vrl.environment import Environment
from vrl.reward import Binary, PartialCredit, RewardShaper
from vrl.types import Task
from vrl_python_tests.datasets import FORMATS, DatasetError, load_source, to_tasks
from vrl_python_tests.verifier import PythonTestsVerifier

REWARDS = ("binary", "partial")


class PythonTestsEnvironment(Environment):
    """Tasks with input/expected tests; attempts run in bubblewrap and are judged on the host."""

    name = "python-tests"
    description = "Write a Python function that passes hidden tests (sandboxed; bundled tasks, MBPP, HumanEval)."
    defaults = {"sampling.max_new_tokens": 384, "verifier.batch_size": 16}

    def __init__(self, tasks: str = "bundled", format: str = "auto", visible_tests: int = 1,
                 reward: str = "binary", sandbox: str = "bwrap", workers: int | None = None,
                 test_timeout_s: float = 2.0, attempt_timeout_s: float = 10.0, memory_mb: int = 512,
                 max_processes: int = 16, python: str | None = None):
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.reward = reward
        self.visible_tests = int(visible_tests)
        self.format = format
        self._tasks = load_source(str(tasks), format, self.visible_tests)
        self.splits = tuple(sorted({t.data["split"] for t in self._tasks}, key=lambda s: (s != "train", s)))
        self._verifier_options: dict[str, Any] = {
            "sandbox": sandbox, "workers": workers, "test_timeout_s": test_timeout_s,
            "attempt_timeout_s": attempt_timeout_s, "memory_mb": memory_mb, "max_processes": max_processes,
            "python": python}
        PythonTestsVerifier(**self._verifier_options).pool.close()  # fail now if the sandbox cannot run here

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        out = [t for t in self._tasks if t.data["split"] == split]
        return out if limit is None else out[:limit]

    def verifier(self) -> PythonTestsVerifier:
        return PythonTestsVerifier(**self._verifier_options)

    def shaper(self) -> RewardShaper:
        return PartialCredit() if self.reward == "partial" else Binary()

    def task_from_data(self, data: dict[str, Any]) -> Task:
        """Inline tasks for `vrl verify`: a vrl/MBPP/HumanEval row, or a Task with prepared tests."""
        if "data" in data and "id" in data:
            return Task.model_validate(data)
        row = {"id": "inline", "text": "", **data}
        try:
            return to_tasks([("inline task", row)], self.format, self.visible_tests)[0]
        except DatasetError as exc:
            raise ValueError(str(exc)) from None
