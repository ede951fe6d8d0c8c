"""The python-tests verifier: extract code, run it in a warm sandbox, compare results on the host.

Scoring: every test is one call of the entry point. A test passes only when the value that came back
over the result channel, decoded into built-in types here, compares equal to the expected value.
The score is the fraction of tests passed; the verdict passes only when all do. Per-test outcomes
(passed, wrong, raised, timeout, crashed) are kept in a `Report` and summarised in the verdict's
detail; hidden tests are named but their inputs and expected values are not shown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import Verifier, verifier_error
from vrl_python_tests.checks import TestCase
from vrl_python_tests.extract import extract_code
from vrl_python_tests.sandbox import CallResult, LocalSandboxPool, LocalSandboxUnavailable, SandboxConfig

MAX_CODE_CHARS = 64_000
MAX_DETAIL_LINES = 6
OutcomeStatus = Literal["passed", "wrong", "error", "timeout", "crashed"]
_STATUS_WORDS = {"wrong": "wrong answer", "error": "raised an exception", "timeout": "timed out", "crashed": "crashed"}


@dataclass
class TestOutcome:
    """How one test went."""

    __test__ = False  # not a pytest class

    index: int
    hidden: bool
    status: OutcomeStatus
    message: str = ""
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Report:
    """Everything known about one attempt: the verdict plus per-test outcomes and captured output."""

    verdict: Verdict
    tests: list[TestOutcome] = field(default_factory=list)
    output: str = ""
    code: str | None = None


class PythonTestsVerifier(Verifier):
    """Judges Python attempts against input/expected tests inside bubblewrap sandboxes."""

    name = "python-tests"

    def __init__(self, sandbox: str = "bwrap", workers: int | None = None, test_timeout_s: float = 2.0,
                 attempt_timeout_s: float = 10.0, memory_mb: int = 512, max_processes: int = 16,
                 python: str | None = None, max_output_bytes: int = 4096):
        if test_timeout_s <= 0 or attempt_timeout_s <= 0:
            raise ValueError("test_timeout_s and attempt_timeout_s must be positive")
        self.config = SandboxConfig(mode=sandbox, memory_mb=int(memory_mb), max_processes=int(max_processes),  # type: ignore[arg-type]
                                    python=python, max_output_bytes=int(max_output_bytes))
        self.test_timeout_s = float(test_timeout_s)
        self.attempt_timeout_s = float(attempt_timeout_s)
        self.pool = LocalSandboxPool(self.config, int(workers) if workers else None)
        self.pool.preflight()  # a machine without bubblewrap fails here, with what to install
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- the async interface the loop uses --
    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        """One verdict per attempt; at most `workers` attempts run at once, whatever the callers do."""
        loop = asyncio.get_running_loop()
        executor = self._get_executor()
        futures = [loop.run_in_executor(executor, self.judge, a) for a in attempts]
        reports = await asyncio.gather(*futures)
        return [r.verdict for r in reports]

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop every sandbox and the worker threads."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.pool.workers, "vrl-python-tests")
            return self._executor

    # -- one attempt, synchronously --
    def judge(self, attempt: Attempt) -> Report:
        """Judge one attempt. Never raises for a bad attempt; a broken sandbox setup does raise."""
        start = time.perf_counter()
        try:
            return self._judge(attempt, start)
        except LocalSandboxUnavailable:
            raise  # a setup problem, not the attempt's fault: the run must stop and say what is missing
        except Exception as exc:  # noqa: BLE001 - a verifier bug or a hostile value costs one verdict, not the batch
            return Report(verifier_error(exc, elapsed_s=time.perf_counter() - start))

    def _judge(self, attempt: Attempt, start: float) -> Report:
        try:
            entry, tests, prefix = task_tests(attempt.task)
        except (KeyError, TypeError, ValueError) as exc:
            verdict = Verdict.fail(Status.REJECTED, f"task {attempt.task.id!r} has no usable tests: {exc}")
            return Report(verdict)
        code = extract_code(attempt.completion.text, entry, prefix)
        if code is None:
            return Report(Verdict.fail(Status.REJECTED, "no Python code found in the completion",
                                       elapsed_s=time.perf_counter() - start))
        if len(code) > MAX_CODE_CHARS:
            return Report(Verdict.fail(Status.REJECTED, f"code longer than {MAX_CODE_CHARS} characters",
                                       elapsed_s=time.perf_counter() - start), code=code)
        run = self.pool.run(code, entry, [t.inputs() for t in tests], self.test_timeout_s, self.attempt_timeout_s)
        elapsed = time.perf_counter() - start
        if run.import_status != "ok":
            status = {"syntax": Status.REJECTED, "timeout": Status.TIMEOUT, "error": Status.FAILED}.get(
                run.import_status, Status.CRASHED)
            what = {"syntax": "does not compile", "timeout": "timed out while loading",
                    "error": "raised while loading"}.get(run.import_status, "crashed while loading")
            detail = f"code {what}: {run.import_error}"
            outcomes = [TestOutcome(i, t.hidden, "crashed", "not run") for i, t in enumerate(tests)]
            return Report(Verdict.fail(status, detail, elapsed_s=elapsed), outcomes, run.output, code)
        outcomes = [_outcome(i, test, raw) for i, (test, raw) in enumerate(zip(tests, run.tests))]
        return Report(_verdict(outcomes, entry, tests, run.attempt_timed_out, elapsed),
                      outcomes, run.output, code)


def task_tests(task: Task) -> tuple[str, list[TestCase], str | None]:
    """The entry point, tests and completion prefix stored in a task's data."""
    data = task.data
    entry = data["entry_point"]
    tests = [TestCase.model_validate(t) for t in data["tests"]]
    if not tests:
        raise ValueError("the task lists no tests")
    return entry, tests, data.get("prefix")


def _outcome(index: int, test: TestCase, raw: CallResult) -> TestOutcome:
    elapsed = raw.elapsed_s
    if raw.kind == "value":
        ok, why = test.check(raw.value)
        return TestOutcome(index, test.hidden, "passed" if ok else "wrong", why, elapsed)
    if raw.kind == "error":
        return TestOutcome(index, test.hidden, "error", f"raised {raw.message}", elapsed)
    if raw.kind == "timeout":
        return TestOutcome(index, test.hidden, "timeout", "timed out", elapsed)
    return TestOutcome(index, test.hidden, "crashed", f"crashed: {raw.message or 'unknown'}", elapsed)


def _verdict(outcomes: list[TestOutcome], entry: str, tests: list[TestCase], attempt_timed_out: bool,
             elapsed: float) -> Verdict:
    passed = sum(o.passed for o in outcomes)
    total = len(outcomes)
    visible = [o for o in outcomes if not o.hidden]
    hidden = [o for o in outcomes if o.hidden]
    head = f"{passed}/{total} tests passed"
    if visible and hidden:
        head += (f" (visible {sum(o.passed for o in visible)}/{len(visible)}, "
                 f"hidden {sum(o.passed for o in hidden)}/{len(hidden)})")
    if passed == total:
        return Verdict.ok(head, elapsed_s=elapsed)
    lines = [head + ("; the attempt ran out of time" if attempt_timed_out else "")]
    for o in [o for o in outcomes if not o.passed][:MAX_DETAIL_LINES]:
        if o.hidden:
            lines.append(f"hidden test {o.index}: {_STATUS_WORDS[o.status]}")  # never reveal hidden inputs or values
        else:
            lines.append(f"test {o.index} {tests[o.index].call_text(entry)}: {o.message}")
    statuses = {o.status for o in outcomes}
    if attempt_timed_out or "timeout" in statuses:
        status = Status.TIMEOUT
    elif "crashed" in statuses:
        status = Status.CRASHED
    else:
        status = Status.FAILED
    # What the attempt printed stays in the Report (the host's), never in the verdict: a verdict's detail
    # reaches samples.jsonl and, with `-o turns>1`, the model.
    return Verdict.fail(status, "\n".join(lines), score=passed / total, elapsed_s=elapsed)
