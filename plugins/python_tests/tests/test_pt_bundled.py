"""The bundled tasks: well formed, canonical solutions pass in the sandbox, known-wrong ones fail."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import attempt, needs_bwrap
from vrl_python_tests.datasets import bundled_path, load_source, read_rows

from vrl.types import Status

ROWS = [row for _, row in read_rows(bundled_path())]
TASKS = load_source("bundled")


def test_bundled_set_is_complete_and_well_formed():
    assert len(ROWS) >= 40
    assert len(TASKS) == len(ROWS), "every bundled row must convert"
    assert len({t.id for t in TASKS}) == len(TASKS)
    assert {t.data["split"] for t in TASKS} == {"train", "test"}
    for row, task in zip(ROWS, TASKS):
        assert row["hidden_tests"], f"{row['id']} needs hidden tests"
        hidden = [t for t in task.data["tests"] if t["hidden"]]
        assert len(hidden) == len(row["hidden_tests"])
        for test in row["hidden_tests"]:
            assert test not in task.prompt, f"{row['id']}: a hidden test leaked into the prompt"
        for test in row["tests"]:
            assert test in task.prompt
        assert f"`{row['entry_point']}`" in task.prompt
        assert "expected" not in json.dumps(task.prompt)


@needs_bwrap
def test_canonical_solutions_pass_and_wrong_ones_fail(verifier):
    solutions = [attempt(t, f"```python\n{row['solution']}```") for t, row in zip(TASKS, ROWS)]
    wrong = [attempt(t, f"```python\n{row['wrong']}```") for t, row in zip(TASKS, ROWS)]
    verdicts = asyncio.run(verifier.verify(solutions + wrong))
    good, bad = verdicts[: len(TASKS)], verdicts[len(TASKS):]
    failures = [(t.id, v.detail) for t, v in zip(TASKS, good) if not v.passed]
    assert failures == []
    passes = [t.id for t, v in zip(TASKS, bad) if v.passed]
    assert passes == [], "these wrong solutions pass: the tests are too weak"
    assert all(v.status is Status.FAILED and 0.0 <= v.score < 1.0 for v in bad)


@pytest.mark.parametrize("mutation", ["return None", "raise ValueError('no')"])
@needs_bwrap
def test_trivial_mutants_fail_everywhere(verifier, mutation):
    attempts = [attempt(t, f"def {t.data['entry_point']}(*args, **kwargs):\n    {mutation}\n") for t in TASKS]
    verdicts = asyncio.run(verifier.verify(attempts))
    assert not any(v.passed for v in verdicts)
