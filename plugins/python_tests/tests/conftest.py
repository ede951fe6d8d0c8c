"""Shared fixtures: a real bubblewrap-backed verifier and helpers to judge code against inline tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from vrl_python_tests.datasets import to_tasks
from vrl_python_tests.sandbox import LocalSandboxUnavailable, check_bwrap, pick_python
from vrl_python_tests.verifier import PythonTestsVerifier, Report

from vrl.types import Attempt, Completion, Task


def _bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian package `bubblewrap`)"
    try:
        check_bwrap(pick_python(None, "bwrap"))
    except LocalSandboxUnavailable as exc:
        return str(exc)
    return None


BWRAP_PROBLEM = _bwrap_problem()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"needs a working bubblewrap: {BWRAP_PROBLEM}")


def make_task(entry_point: str, tests: list[str], hidden: list[str] | None = None, task_id: str = "t") -> Task:
    row = {"id": task_id, "text": "test task", "entry_point": entry_point, "tests": tests, "hidden_tests": hidden or []}
    return to_tasks([("inline", row)], "vrl")[0]


def attempt(task: Task, text: str) -> Attempt:
    return Attempt(task=task, completion=Completion(task_id=task.id, text=text))


def sandboxed(**kw) -> Iterator[PythonTestsVerifier]:
    """For a fixture to `yield from`: a verifier on real bubblewrap sandboxes (the test skips without
    one), closed after."""
    if BWRAP_PROBLEM is not None:
        pytest.skip(f"needs a working bubblewrap: {BWRAP_PROBLEM}")
    v = PythonTestsVerifier(**kw)
    yield v
    v.close()


@pytest.fixture(scope="module")
def verifier():
    """Two warm sandboxes with short timeouts, shared by a test module."""
    yield from sandboxed(workers=2, test_timeout_s=1.0, attempt_timeout_s=4.0, memory_mb=256, max_processes=8)


@pytest.fixture
def judge(verifier):
    """judge(code, task) -> Report, through the real sandbox."""

    def run(code: str, task: Task) -> Report:
        return verifier.judge(attempt(task, code))

    return run
