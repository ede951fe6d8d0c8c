"""`vrl verify`: judge a JSONL file of ready-made attempts, one verdict per line, in input order."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vrl.environment import Environment
from vrl.types import Attempt, Completion, Status, Task, Verdict
from vrl.verifier import verify_safely


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
        task = env.task_from_data(row["task"])
    elif "task_id" in row:
        task_id = str(row["task_id"])
        if task_id not in index:
            raise ValueError(f"unknown task_id {task_id!r} for environment {env.name!r}")
        task = index[task_id]
    else:
        raise ValueError('each line needs "task_id" (a task of the environment) or "task" (inline)')
    return Attempt(task=task, completion=Completion(task_id=task.id, text=text))


async def verify_lines(env: Environment, lines: Sequence[str], splits: Sequence[str] | None = None, batch_size: int = 64) -> list[dict[str, Any]]:
    """Verify every non-blank line; malformed lines get a `rejected` verdict naming the problem."""
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
    for key, empty in (("metrics", {}), ("alarm", None)):  # a verifier's counters and alarms only when it has some
        if row.get(key) == empty:
            row.pop(key)
    return row
