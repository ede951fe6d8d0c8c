"""Shared fixtures: a real bubblewrap-backed verifier and helpers to judge code against inline tests.

Every sandbox these fixtures make runs under gVisor's rules for bubblewrap (`gvisor_rules`): the
stand-in `tests/fixtures/gvisor/bwrap` refuses what Modal's gVisor refuses, so vrl's jail keeps the
host's network namespace and relies on its seccomp filter alone, the weaker of its two set-ups. An
attack contained there is contained with a network namespace of the sandbox's own too (the only
difference is that namespace); test_pt_sandbox.py checks that the other set-up starts and judges.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vrl_python_tests.datasets import to_tasks
from vrl_python_tests.sandbox import LocalSandboxUnavailable, check_bwrap, pick_python
from vrl_python_tests.verifier import PythonTestsVerifier, Report

from vrl import jail
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


GVISOR_BWRAP = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "gvisor" / "bwrap"


@contextlib.contextmanager
def gvisor_rules() -> Iterator[None]:
    """bwrap as gVisor lets it run (`tests/fixtures/gvisor/bwrap` first on PATH) for the block's life;
    the sandboxes resolve bwrap on every start, so a restarted one keeps the rules."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{GVISOR_BWRAP.parent}:{os.environ['PATH']}")
        yield


def sandboxed(**kw) -> Iterator[PythonTestsVerifier]:
    """For a fixture to `yield from`: a verifier on real bubblewrap sandboxes under gVisor's rules (the
    test skips without bubblewrap), closed after."""
    if BWRAP_PROBLEM is not None:
        pytest.skip(f"needs a working bubblewrap: {BWRAP_PROBLEM}")
    with gvisor_rules():
        v = PythonTestsVerifier(**kw)
        assert jail.probe().network == "shared"  # the stand-in applies: the sandbox keeps the host's network namespace
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
