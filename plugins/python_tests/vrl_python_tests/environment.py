"""The python-tests environment: write a Python function that passes hidden tests in a sandbox."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from vrl.environment import Environment, EnvOptions
from vrl.repair import RepairEpisodes
from vrl.reward import Binary, PartialCredit, RewardShaper
from vrl.types import Task, Verdict
from vrl_python_tests.datasets import DatasetError, load_source, to_tasks
from vrl_python_tests.sandbox import SandboxMode
from vrl_python_tests.verifier import PythonTestsVerifier


class PythonTestsOptions(EnvOptions):
    """`-o` options of python-tests."""

    tasks: str = Field("bundled", description="'bundled', a .jsonl/.json/.parquet file, or hf:<dataset>[:<config>].")
    format: Literal["auto", "vrl", "mbpp", "humaneval"] = Field("auto", description="Row format of the task source.")
    visible_tests: int = Field(1, ge=0, description="Tests shown in the prompt; the rest are hidden.")
    reward: Literal["binary", "partial"] = Field("binary", description="'binary' (all tests pass) or 'partial' (share passed).")
    sandbox: SandboxMode = Field("bwrap", description="'bwrap' (bubblewrap isolation) or 'unsafe-local' (none: trusted code only).")
    workers: int | None = Field(None, ge=1, description="Sandboxes at once; None: one per CPU core.")
    test_timeout_s: float = Field(2.0, gt=0, description="Wall-clock limit per test.")
    attempt_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per attempt (import + all tests).")
    memory_mb: int = Field(512, ge=64, description="Address-space cap of each process of an attempt.")
    max_processes: int = Field(16, ge=1, description="Processes (and threads) an attempt may run at once.")
    python: str | None = Field(None, description="Interpreter inside the sandbox; None picks one the sandbox can run.")
    turns: int = Field(1, ge=1, le=16, description="Model turns per task: with more than 1, a failing attempt's test "
                       "report (the visible tests' calls and results, hidden ones by index only) goes back for a fix.")
    feedback_chars: int = Field(1200, ge=80, description="Characters of a failing attempt's report sent back (turns > 1).")


def tests_feedback(task: Task, text: str, verdict: Verdict) -> str:
    """What the model reads after a failing attempt: the verifier's report (it never shows hidden tests' data)."""
    return f"The code failed the tests ({verdict.status.value}):\n{verdict.detail}\nFix it and write the whole code again."


class PythonTestsEnvironment(RepairEpisodes, Environment):
    """Tasks with input/expected tests; attempts run in bubblewrap and are judged on the host. With
    `-o turns=K`, a failing attempt's test report goes back and the model fixes its code."""

    name = "python-tests"
    description = "Write a Python function that passes hidden tests (sandboxed; bundled tasks, MBPP, HumanEval)."
    defaults = {"sampling.max_new_tokens": 384, "verifier.batch_size": 16}
    Options = PythonTestsOptions
    feedback = staticmethod(tests_feedback)

    def __init__(self, **options: Any):
        """Options (`-o KEY=VALUE`): see `PythonTestsOptions`."""
        o = self.parse_options(options)
        self.reward = o.reward
        self.visible_tests = o.visible_tests
        self.format = o.format
        self._tasks = load_source(o.tasks, o.format, o.visible_tests)
        self.splits = tuple(sorted({t.data["split"] for t in self._tasks}, key=lambda s: (s != "train", s)))
        self._verifier_options: dict[str, Any] = {
            "sandbox": o.sandbox, "workers": o.workers, "test_timeout_s": o.test_timeout_s,
            "attempt_timeout_s": o.attempt_timeout_s, "memory_mb": o.memory_mb, "max_processes": o.max_processes,
            "python": o.python}
        # No sandbox check here: the environment is also built where nothing is judged (a detached Modal
        # orchestrator, whose image has no bubblewrap). `verifier()` checks where it judges, before any attempt.
        self.turns, self.feedback_chars = o.turns, o.feedback_chars  # repair: every turn judged in the sandbox

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

