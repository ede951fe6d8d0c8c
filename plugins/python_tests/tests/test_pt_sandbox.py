"""Sandbox mechanics: options that shape limits, restarts, concurrency, and clear errors when bwrap is missing."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
from conftest import BWRAP_PROBLEM, attempt, gvisor_rules, make_task, needs_bwrap
from vrl_python_tests.sandbox import LocalSandboxUnavailable, SandboxConfig, check_bwrap, pick_python
from vrl_python_tests.verifier import PythonTestsVerifier

from vrl.types import Status

ADD = make_task("add", ["assert add(1, 2) == 3"], ["assert add(2, 2) == 4"])
CORRECT = "def add(a, b):\n    return a + b\n"


def make(**kw) -> PythonTestsVerifier:
    if BWRAP_PROBLEM is not None and kw.get("sandbox") != "unsafe-local":
        pytest.skip(BWRAP_PROBLEM)
    opts = {"workers": 1, "test_timeout_s": 1.0, "attempt_timeout_s": 4.0}
    opts.update(kw)
    return PythonTestsVerifier(**opts)


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """A PATH on which bwrap does not exist (python3 is found by absolute path)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    check_bwrap.cache_clear()
    yield
    check_bwrap.cache_clear()


def test_missing_bwrap_is_a_clear_error(no_bwrap):
    with pytest.raises(LocalSandboxUnavailable, match=r"bubblewrap.*apt-get install bubblewrap.*sandbox=unsafe-local"):
        PythonTestsVerifier()


def test_broken_bwrap_names_user_namespaces(monkeypatch):
    # World-searchable, because as root the sandbox runs bwrap under an unprivileged uid.
    fake_dir = Path(tempfile.mkdtemp(prefix="vrl-fake-bwrap-"))
    fake_dir.chmod(0o755)
    fake = fake_dir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_dir}:{os.environ['PATH']}")
    check_bwrap.cache_clear()
    try:
        with pytest.raises(LocalSandboxUnavailable, match=r"No permissions to create new namespace.*user namespaces"):
            PythonTestsVerifier()
    finally:
        check_bwrap.cache_clear()
        shutil.rmtree(fake_dir)


def test_unsafe_local_runs_without_bwrap_and_is_really_unisolated(no_bwrap, tmp_path):
    """Opting out works and judges correctly; a host file is readable there, unlike in the sandbox."""
    v = make(sandbox="unsafe-local", workers=1)
    try:
        assert v.judge(attempt(ADD, CORRECT)).verdict.passed
        assert not v.judge(attempt(ADD, "def add(a, b):\n    return a - b\n")).verdict.passed
        secret = tmp_path / "secret.txt"
        secret.write_text("visible-outside-the-sandbox")
        task = make_task("read", [f"assert read({str(secret)!r}) == 'visible-outside-the-sandbox'"])
        code = "def read(path):\n    return open(path).read()\n"
        assert v.judge(attempt(task, code)).verdict.passed  # the adversarial suite would catch this in bwrap mode
    finally:
        v.close()


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="sandbox must be one of"):
        SandboxConfig(mode="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=8)
    with pytest.raises(ValueError, match="positive"):
        PythonTestsVerifier(sandbox="unsafe-local", test_timeout_s=0)
    with pytest.raises(LocalSandboxUnavailable, match="not an executable"):
        pick_python("/nonexistent/python3", "bwrap")


@needs_bwrap
def test_python_option_selects_the_interpreter():
    task = make_task("exe", ["assert exe() == 'x'"])
    v = make(python="/usr/bin/python3")
    try:
        report = v.judge(attempt(task, "import sys\ndef exe():\n    return sys.executable\n"))
        assert "returned '/usr/bin/python3" in report.tests[0].message
    finally:
        v.close()


@needs_bwrap
def test_memory_mb_sets_the_cap():
    task = make_task("grab", ["assert grab() == 'ok'"])
    # An untouched mapping counts against the address-space cap but costs the host no RAM.
    code = "import mmap\ndef grab():\n    m = mmap.mmap(-1, 200 * 1024 * 1024)\n    return 'ok'\n"
    small, large = make(memory_mb=128), make(memory_mb=512)
    try:
        small_detail = small.judge(attempt(task, code)).verdict.detail
        assert "Cannot allocate memory" in small_detail, small_detail
        large_verdict = large.judge(attempt(task, code)).verdict
        assert large_verdict.passed, large_verdict.detail
    finally:
        small.close()
        large.close()


@needs_bwrap
def test_max_processes_sets_the_cap():
    task = make_task("spawn", ["assert spawn(10) == 10"])
    code = """
import os, time
def spawn(n):
    made = 0
    for _ in range(n):
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
        except OSError:
            break
        made += 1
    return made
"""
    few, many = make(max_processes=4), make(max_processes=16)
    try:
        report = few.judge(attempt(task, code))
        assert not report.verdict.passed and "returned 3" in report.verdict.detail  # 4 = the attempt + 3
        assert many.judge(attempt(task, code)).verdict.passed
    finally:
        few.close()
        many.close()


@needs_bwrap
def test_attempt_timeout_bounds_the_whole_attempt():
    """The attempt's deadline stops a test that its own (much longer) test timeout would let finish,
    and the tests after it are never run: an ordering of outcomes, no clock. Were the deadline checked
    only between tests, test 2 would sleep its 60 s and pass; were it not enforced, every test would pass."""
    tests = [f"assert add({i}, 0) == {i}" for i in range(6)]
    task = make_task("add", tests)
    v = make(test_timeout_s=120.0, attempt_timeout_s=3.0)  # 3 s: room for tests 0 and 1 on a loaded machine
    try:
        report = v.judge(attempt(task, "import time\ndef add(a, b):\n    if a == 2:\n        time.sleep(60)\n"
                                       "    return a + b\n"))
        assert report.verdict.status is Status.TIMEOUT and "ran out of time" in report.verdict.detail
        assert [t.status for t in report.tests] == ["passed", "passed"] + ["timeout"] * 4
    finally:
        v.close()


@needs_bwrap
def test_output_is_capped_and_never_blocks():
    v = make(max_output_bytes=100)
    try:
        code = "import sys\nsys.stdout.write('y' * 5_000_000)\nsys.stdout.flush()\nraise RuntimeError('boom')\n"
        report = v.judge(attempt(ADD, code))
        assert report.verdict.status is Status.FAILED and "RuntimeError: boom" in report.verdict.detail
        assert report.output == "y" * 100
    finally:
        v.close()


@needs_bwrap
def test_huge_return_values_fail_the_test():
    v = make()
    try:
        code = "def add(a, b):\n    return 'x' * (3 * 1024 * 1024) if a == 1 else a + b\n"
        report = v.judge(attempt(ADD, code))
        assert [t.status for t in report.tests] == ["error", "passed"]
        assert "larger than" in report.tests[0].message
    finally:
        v.close()


@needs_bwrap
def test_a_dead_sandbox_is_restarted():
    v = make()
    try:
        assert v.judge(attempt(ADD, CORRECT)).verdict.passed
        box = v.pool._all[0]
        box.proc.kill()  # the container dies between attempts
        box.proc.wait()
        assert v.judge(attempt(ADD, CORRECT)).verdict.passed
        assert v.pool.starts == 2
    finally:
        v.close()


@needs_bwrap
def test_workers_bound_concurrency_across_batches_and_loops():
    v = make(workers=2)
    code = "import time\ndef add(a, b):\n    time.sleep(0.15)\n    return a + b\n"
    try:
        async def two_batches():
            batch = [attempt(ADD, code) for _ in range(4)]
            return await asyncio.gather(v.verify(batch), v.verify(batch))

        start = time.monotonic()
        results = asyncio.run(two_batches())
        elapsed = time.monotonic() - start
        assert all(verdict.passed for batch in results for verdict in batch)
        # 8 attempts x 2 tests x 0.15 s on 2 workers cannot take less than 1.2 s; serial would be 2.4 s.
        assert elapsed >= 1.2
        assert v.pool.starts == 2
        assert asyncio.run(v.verify([attempt(ADD, CORRECT)]))[0].passed  # a second event loop works too
    finally:
        v.close()


@needs_bwrap
def test_verify_returns_one_verdict_per_attempt_in_order():
    v = make(workers=2)
    texts = [CORRECT, "no code here", "def add(a, b):\n    return 0\n", "def add(a, b:\n", CORRECT]
    try:
        verdicts = asyncio.run(v.verify([attempt(ADD, t) for t in texts]))
    finally:
        asyncio.run(v.aclose())
    assert [v.status for v in verdicts] == [Status.PASSED, Status.REJECTED, Status.FAILED, Status.REJECTED,
                                            Status.PASSED]
    assert verdicts[2].score == 0.0 and "does not compile" in verdicts[3].detail


def test_python_inside_the_sandbox_is_readable_by_its_uid():
    python = pick_python(None, "bwrap")
    assert os.path.isabs(python) and os.access(python, os.X_OK)


@needs_bwrap
def test_file_size_and_scratch_space_are_capped():
    task = make_task("fill", ["assert fill() == 'wrote 32 MiB'"])
    code = """
def fill():
    try:
        with open('/tmp/big', 'wb') as f:
            for _ in range(32):
                f.write(b'x' * (1 << 20))
                f.flush()
    except OSError as e:
        return type(e).__name__
    return 'wrote 32 MiB'
"""
    v = make()  # max_file_mb defaults to 16: RLIMIT_FSIZE and the tmpfs size
    try:
        report = v.judge(attempt(task, code))
        assert not report.verdict.passed and "returned 'OSError'" in report.verdict.detail
    finally:
        v.close()


def test_each_kind_of_call_result_becomes_its_test_outcome():
    """What the sandbox returns per test (a typed `CallResult`) is judged on the host into a `TestOutcome`."""
    from vrl_python_tests.checks import TestCase
    from vrl_python_tests.harness import encode
    from vrl_python_tests.sandbox import CallResult
    from vrl_python_tests.verifier import _outcome

    test = TestCase(args=encode([1, 2]), expected=encode(3))
    judged = [_outcome(0, test, raw) for raw in (
        CallResult("value", 0.5, value=encode(3)), CallResult("value", value=encode(4)),
        CallResult("error", message="ZeroDivisionError: division by zero"), CallResult("timeout", 2.0),
        CallResult("crashed", message="not run"), CallResult("crashed"))]
    assert [o.status for o in judged] == ["passed", "wrong", "error", "timeout", "crashed", "crashed"]
    assert judged[0].elapsed_s == 0.5 and judged[3].elapsed_s == 2.0
    assert judged[2].message == "raised ZeroDivisionError: division by zero"
    assert [judged[4].message, judged[5].message] == ["crashed: not run", "crashed: unknown"]


@needs_bwrap
def test_the_server_without_pidfd_open_judges_attempt_after_attempt(monkeypatch):
    """Where pidfd_open is missing (gVisor's release 20240729 answers ENOSYS; tests/test_gvisor_real.py runs it
    there) the sandbox server learns of an attempt's exit from SIGCHLD instead. Forced here on Linux: one sandbox
    judges a run of attempts that pass, fail, time out, exit early and crash, each with its own verdict, and
    the sandbox is never restarted (a server that died after an attempt was, before)."""
    import vrl_python_tests.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "SERVER_PIDFD", False)
    task = make_task("add", ["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    cases = [("def add(a, b):\n    return a + b\n", "passed"), ("def add(a, b):\n    return a - b\n", "failed"),
             ("def add(a, b):\n    while True:\n        pass\n", "timeout"), ("import os\nos._exit(0)\n", "crashed"),
             ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "crashed"),
             ("def add(a, b):\n    return a + b\n", "passed")]
    with gvisor_rules():
        v = PythonTestsVerifier(workers=1, test_timeout_s=1.0, attempt_timeout_s=4.0, memory_mb=256, max_processes=8)
        try:
            got = [v.judge(attempt(task, code)).verdict.status.value for code, _ in cases]
            starts = v.pool.starts
        finally:
            v.close()
    assert got == [want for _, want in cases], got
    assert starts == 1, starts  # one server judged them all
