"""`vrl verify`: judge a JSONL file of ready-made attempts, one verdict per line, in input order."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from vrl.environment import Environment
from vrl.errors import UsageError
from vrl.types import Attempt, Completion, Status, Task, Verdict
from vrl.verifier import verify_safely


class TaskError(UsageError, ValueError):
    """A line's inline task is not one the environment can build: the input is wrong, not the attempt, so
    `vrl verify` stops (exit 2) before judging anything."""


def _problem(exc: Exception) -> str:
    """What is wrong with an inline task, in one line (a pydantic error lists each field and its problem)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'task'}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors())
    return " ".join(str(exc).split()) or type(exc).__name__


def _parse(line: str, env: Environment, index: dict[str, Task]) -> Attempt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    text = row.get("completion")
    if not isinstance(text, str):
        raise ValueError('missing "completion" (the attempt text, a string)')
    if "task" in row:
        if not isinstance(row["task"], dict):
            raise ValueError('"task" must be an object')
        try:
            task = env.task_from_data(row["task"])
        except Exception as exc:
            raise TaskError(f"{_problem(exc)}") from exc
    elif "task_id" in row:
        task_id = str(row["task_id"])
        if task_id not in index:
            raise ValueError(f"unknown task_id {task_id!r} for environment {env.name!r}")
        task = index[task_id]
    else:
        raise ValueError('each line needs "task_id" (a task of the environment) or "task" (inline)')
    return Attempt(task=task, completion=Completion(task_id=task.id, text=text))


async def verify_lines(env: Environment, lines: Sequence[str], splits: Sequence[str] | None = None, batch_size: int = 64) -> list[dict[str, Any]]:
    """Verify every non-blank line; malformed lines get a `rejected` verdict naming the problem.

    An inline task the environment cannot build is the input's fault, not the attempt's: `TaskError`
    (one line naming the line and the problem), before anything is verified."""
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    index: dict[str, Task] = {}
    if any('"task_id"' in line for _, line in numbered):
        for split in splits or env.splits:
            index.update({t.id: t for t in env.tasks(split)})
    rows: list[dict[str, Any] | None] = [None] * len(numbered)
    good: list[tuple[int, Attempt]] = []
    for slot, (number, line) in enumerate(numbered):
        try:
            good.append((slot, _parse(line, env, index)))
        except TaskError as exc:
            raise TaskError(f"line {number}: ill-formed task for environment {env.name!r}: {exc}; give its inline form "
                            "or the Task fields id, prompt and data (docs/cli.md); nothing was verified") from None
        except Exception as exc:
            verdict = Verdict.fail(Status.REJECTED, f"line {number}: {exc}")
            rows[slot] = _row(number, None, verdict)
    verifier = env.verifier()
    try:
        for start in range(0, len(good), batch_size):
            chunk = good[start : start + batch_size]
            verdicts = await verify_safely(verifier, [a for _, a in chunk])
            for (slot, attempt), verdict in zip(chunk, verdicts):
                rows[slot] = _row(numbered[slot][0], attempt.task.id, verdict)
    finally:
        await verifier.aclose()
    return [r for r in rows if r is not None]


def _row(line: int, task_id: str | None, verdict: Verdict) -> dict[str, Any]:
    row = {"line": line, "task_id": task_id, **verdict.model_dump(mode="json")}
    # a verifier's counters, alarms and reward functions' values only when it has some
    for key, empty in (("metrics", {}), ("alarm", None), ("rewards", None)):
        if row.get(key) == empty:
            row.pop(key)
    return row
