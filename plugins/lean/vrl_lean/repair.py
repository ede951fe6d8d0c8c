"""Lean proof repair (`-o turns=3`): a failed proof's Lean error goes back to the model, which tries again.

Each turn's proof goes through the whole `LeanVerifier` (the policy's rebuild and allow-list, Lean on
the server, the out-of-process re-check, canaries), as a final attempt does (`vrl.repair.Repair`).
The report of a failure names the error's position and message, as the verdict does, and the failing
line of the file Lean checked (rebuilt with the policy's own `prepare`, at the line kimina-lean-server
counts from), trimmed to `-o feedback_chars=N`.
"""

from __future__ import annotations

import re

from vrl.types import Task, Verdict
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS, Rejected, prepare
from vrl_lean.verifier import theorem_of

_POSITION = re.compile(r"at line (\d+), column (\d+)")


def failing_line(task: Task, text: str, verdict: Verdict, max_heartbeats: int = DEFAULT_MAX_HEARTBEATS) -> str | None:
    """The line of the checked file that the verdict's position points at (None when it names none)."""
    found = _POSITION.search(verdict.detail)
    if not found:
        return None
    try:
        submission = prepare(text, theorem_of(task.data), max_heartbeats, rechecked=True)
    except (Rejected, ValueError):
        return None
    lines = submission.code.splitlines()[submission.header_lines :]
    number = int(found.group(1))
    return lines[number - 1] if 1 <= number <= len(lines) else None


def lean_feedback(task: Task, text: str, verdict: Verdict) -> str:
    """What the model reads after a failed proof: Lean's first error (position and message) and its line."""
    report = f"Lean rejected the proof ({verdict.status.value}): {verdict.detail}"
    line = failing_line(task, text, verdict)
    if line is not None:
        report += f"\nThe failing line:\n{line}"
    return report + "\nFix the proof and write the complete Lean 4 proof again."
