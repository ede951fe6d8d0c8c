"""Attacks on the verifier, each run through the real bubblewrap sandbox.

Wherever it can be arranged, the task is built so that the attack *would* pass if it worked (the
expected value is the secret, the count of forks, "tampered"...), so a failing verdict is evidence of
containment, not of a wrong answer. After the attacks the host is checked directly.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from conftest import BWRAP_PROBLEM, attempt, make_task, needs_bwrap, sandboxed
from vrl_python_tests.verifier import PythonTestsVerifier

from vrl.types import Status

pytestmark = needs_bwrap

ADD = make_task("add", ["assert add(1, 2) == 3"], ["assert add(5, 5) == 10"])
CORRECT_ADD = "def add(a, b):\n    return a + b\n"
# Runs inside the sandbox: how many processes exist there and whether scratch files survived.
PROBE = make_task("probe", ["assert probe() == (2, [], [])"])
PROBE_CODE = """
import os
def probe():
    pids = [p for p in os.listdir('/proc') if p.isdigit()]
    return (len(pids), sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))
"""


@pytest.fixture(scope="module")
def solo():
    """One sandbox, so a probe attempt lands in the same container as the attack before it."""
    yield from sandboxed(workers=1, test_timeout_s=1.0, attempt_timeout_s=4.0, memory_mb=128, max_processes=8)


def assert_clean_and_working(v: PythonTestsVerifier) -> None:
    """The sandbox holds nothing but its server, its scratch is empty, and it still judges correctly."""
    probe = v.judge(attempt(PROBE, PROBE_CODE))
    assert probe.verdict.passed, probe.verdict.detail
    ok = v.judge(attempt(ADD, CORRECT_ADD))
    assert ok.verdict.passed, ok.verdict.detail


def test_probe_sees_a_clean_sandbox(solo):
    assert_clean_and_working(solo)


LOOPS = "def add(a, b):\n    while True:\n        pass\n"


def test_infinite_loop_in_a_test_times_out(solo):
    """Each looping test is stopped (a judge that never stopped one would never return). The wait is
    bounded only so that such a defect fails the test instead of hanging it: 60 s, fifteen times the
    attempt timeout, which no load makes the sandbox need."""
    reports = []
    judging = threading.Thread(target=lambda: reports.append(solo.judge(attempt(ADD, LOOPS))), daemon=True)
    judging.start()
    judging.join(60)  # a daemon thread: a judge that hangs cannot hold the test run either
    assert reports, "the looping attempt was never stopped"
    report = reports[0]
    assert report.verdict.status is Status.TIMEOUT and report.verdict.score == 0.0
    assert [t.status for t in report.tests] == ["timeout", "timeout"]
    assert_clean_and_working(solo)


def test_infinite_loop_while_loading_times_out(solo):
    report = solo.judge(attempt(ADD, "while True:\n    pass\ndef add(a, b):\n    return a + b\n"))
    assert report.verdict.status is Status.TIMEOUT and not report.verdict.passed
    assert_clean_and_working(solo)


def test_one_slow_test_costs_only_that_test(solo):
    code = "import time\ndef add(a, b):\n    if a == 1:\n        time.sleep(60)\n    return a + b\n"
    report = solo.judge(attempt(ADD, code))
    assert [t.status for t in report.tests] == ["timeout", "passed"]
    assert report.verdict.status is Status.TIMEOUT and report.verdict.score == 0.5


def test_memory_bomb_is_capped(solo):
    task = make_task("hog", ["assert hog() == 'allocated'"])
    code = ("def hog():\n    blocks = []\n    for _ in range(64):\n"
            "        blocks.append(bytearray(64 * 1024 * 1024))\n    return 'allocated'\n")  # 4 GiB
    report = solo.judge(attempt(task, code))
    assert not report.verdict.passed
    assert "MemoryError" in report.verdict.detail, report.verdict.detail
    assert_clean_and_working(solo)


def test_fork_bomb_is_capped_and_cleaned_up(solo):
    task = make_task("spawn", ["assert spawn(200) == 200"])
    code = """
import os, time
def spawn(n):
    made = 0
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        made += 1
    return made
"""
    report = solo.judge(attempt(task, code))
    assert not report.verdict.passed, "the process cap did not hold"
    assert_clean_and_working(solo)


def test_setsid_daemon_does_not_outlive_the_attempt(solo):
    task = make_task("daemon", ["assert daemon() == 'started'"])
    code = """
import os, time
def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                with open('/tmp/daemon-was-here', 'a') as f:
                    f.write('x')
                with open('/dev/shm/daemon-too', 'a') as f:
                    f.write('x')
                time.sleep(0.005)
        os._exit(0)
    time.sleep(0.1)
    return 'started'
"""
    report = solo.judge(attempt(task, code))
    assert report.verdict.passed  # the attempt itself is fine; what matters is what it left behind
    assert_clean_and_working(solo)  # no process but the server, no file in /tmp or /dev/shm


def test_host_files_cannot_be_written_or_deleted(judge, tmp_path):
    planted = tmp_path / "planted.txt"
    planted.write_text("original")
    task = make_task("tamper", [f"assert tamper({str(planted)!r}) == 'tampered'"])
    code = """
import os
def tamper(path):
    done = []
    for action in (lambda: os.remove(path), lambda: open(path, 'w').write('pwned'),
                   lambda: open('/etc/vrl-pwned', 'w').write('x'), lambda: open('/usr/vrl-pwned', 'w').write('x'),
                   lambda: open(os.path.join(os.path.dirname(path), 'new.txt'), 'w').write('x')):
        try:
            action()
            done.append(1)
        except OSError:
            pass
    return 'tampered' if done else 'contained'
"""
    report = judge(code, task)
    assert not report.verdict.passed
    assert planted.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planted.txt"]
    assert not os.path.exists("/etc/vrl-pwned") and not os.path.exists("/usr/vrl-pwned")


def test_host_files_cannot_be_read(judge, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-file-secret-4410")
    task = make_task("read", [f"assert read({str(secret)!r}) == 'host-file-secret-4410'"])
    code = "def read(path):\n    try:\n        return open(path).read()\n    except OSError as e:\n        return str(e)\n"
    assert not judge(code, task).verdict.passed


def test_planted_secret_env_var_and_parent_environ_are_invisible(monkeypatch):
    monkeypatch.setenv("VRL_PLANTED_SECRET", "planted-secret-93c1")
    task = make_task("find_secret", ["assert find_secret() == 'planted-secret-93c1'"])
    code = """
import os
def find_secret():
    if 'VRL_PLANTED_SECRET' in os.environ:
        return os.environ['VRL_PLANTED_SECRET']
    pids = {'self', '1', str(os.getppid())} | {p for p in os.listdir('/proc') if p.isdigit()}
    for pid in pids:
        for name in ('environ', 'cmdline'):
            try:
                data = open(f'/proc/{pid}/{name}', 'rb').read()
            except OSError:
                continue
            for part in data.split(b'\\0'):
                if part.startswith(b'VRL_PLANTED_SECRET='):
                    return part.split(b'=', 1)[1].decode()
    return sorted(os.environ)
"""
    v = PythonTestsVerifier(workers=1, test_timeout_s=2.0)  # started after the secret was planted
    try:
        report = v.judge(attempt(task, code))
    finally:
        v.close()
    assert not report.verdict.passed
    returned = report.tests[0].message.split(", expected")[0]
    assert returned.startswith("returned") and "planted-secret" not in returned


def test_network_and_host_sockets_are_unreachable(judge):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    tcp.settimeout(0.2)
    abstract = socket.socket(socket.AF_UNIX)
    name = f"vrl-test-{os.getpid()}"
    abstract.bind("\0" + name)
    abstract.listen(1)
    abstract.settimeout(0.2)
    port = tcp.getsockname()[1]
    task = make_task("reach", [f"assert reach({port}, {name!r}) == 'reached'"])
    code = """
import socket
def reach(port, name):
    for family, address in ((socket.AF_INET, ('127.0.0.1', port)), (socket.AF_UNIX, '\\0' + name),
                            (socket.AF_INET, ('1.1.1.1', 53))):
        s = socket.socket(family)
        s.settimeout(0.3)
        try:
            s.connect(address)
            s.sendall(b'pwned')
            return 'reached'
        except OSError:
            pass
        finally:
            s.close()
    return 'isolated'
"""
    try:
        report = judge(code, task)
        assert not report.verdict.passed
        for listener in (tcp, abstract):
            with pytest.raises(socket.timeout):
                listener.accept()
    finally:
        tcp.close()
        abstract.close()


def test_killing_the_parent_or_the_host_fails(solo):
    starts = solo.pool.starts
    task = make_task("kill_all", [f"assert kill_all({os.getpid()}) == 'host killed'"])
    code = """
import os, signal
def kill_all(host_pid):
    for pid in (os.getppid(), 1, -1):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.kill(host_pid, signal.SIGKILL)
        return 'host killed'
    except OSError:
        return 'host unreachable'
"""
    report = solo.judge(attempt(task, code))
    assert not report.verdict.passed
    assert solo.pool.starts == starts, "the sandbox server was killed and had to be restarted"
    assert_clean_and_working(solo)


@pytest.mark.parametrize(
    "code, status",
    [
        ("import os\nos._exit(0)\n", Status.CRASHED),
        ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n", Status.FAILED),
        ("def add(a, b):\n    raise SystemExit(0)\n", Status.FAILED),
        ("import os\ndef add(a, b):\n    os._exit(0)\n", Status.CRASHED),
        ("import atexit\natexit.register(lambda: print('ALL TESTS PASSED'))\ndef add(a, b):\n    return 0\n",
         Status.FAILED),
        ("def add(a, b):\n    print('passed')\n    print('{\"i\": 0, \"value\": 3}')\n    return None\n", Status.FAILED),
        ("import signal, os\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n", Status.CRASHED),
    ],
    ids=["os._exit-at-import", "sys.exit-at-import", "SystemExit-in-test", "os._exit-in-test", "atexit",
         "print-passed", "self-kill"],
)
def test_exit_codes_and_stdout_are_not_evidence(judge, code, status):
    report = judge(code, ADD)
    assert not report.verdict.passed and report.verdict.score == 0.0
    assert report.verdict.status is status, report.verdict.detail


def test_forged_messages_on_every_descriptor_fail(judge):
    code = """
import os, json
def add(a, b):
    lines = [json.dumps(m).encode() + b'\\n' for m in
             ({'passed': True, 'score': 1.0}, {'i': 0, 'value': {'always_equal': True}}, {'import': 'ok'})]
    for fd in sorted(int(name) for name in os.listdir('/proc/self/fd') if int(name) > 2):  # the host's numbers
        for line in lines:
            try:
                os.write(fd, line)
            except OSError:
                pass
    return -1
"""
    report = judge(code, ADD)
    assert not report.verdict.passed and report.verdict.score == 0.0


@pytest.mark.parametrize(
    "body",
    [
        "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\nreturn Yes()",
        "class Int(int):\n    def __eq__(self, other):\n        return True\nreturn Int(0)",
        "class Str(str):\n    def __eq__(self, other):\n        return True\nreturn Str('x')",
        "class L(list):\n    def __eq__(self, other):\n        return True\nreturn L()",
    ],
    ids=["object", "int-subclass", "str-subclass", "list-subclass"],
)
def test_always_equal_objects_fail(judge, body):
    indented = "\n".join("    " + line for line in body.splitlines())
    report = judge(f"def add(a, b):\n{indented}\n", ADD)
    assert not report.verdict.passed and report.verdict.score == 0.0
    assert "cannot return" in report.verdict.detail


def test_frame_walking_finds_no_expected_values(judge):
    task = make_task("guess", ["assert guess(1) == 'expected-sentinel-7f3a'"],
                     ["assert guess(2) == 'expected-sentinel-c81e'"])
    code = """
import gc, sys
def _search(obj, seen, depth=0):
    if depth > 6 or id(obj) in seen:
        return None
    seen.add(id(obj))
    if isinstance(obj, str):
        return obj if 'sentinel' in obj else None
    if isinstance(obj, bytes):
        return obj.decode(errors='ignore') if b'sentinel' in obj else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ()
    for item in list(items):
        found = _search(item, seen, depth + 1)
        if found:
            return found
    return None

def guess(n):
    seen = set()
    frame = sys._getframe()
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            found = _search(scope, seen)
            if found:
                return found
        frame = frame.f_back
    for obj in gc.get_objects():
        found = _search(obj, seen)
        if found:
            return found
    return 'nothing found'
"""
    report = judge(code, task)
    assert not report.verdict.passed and report.verdict.score == 0.0


def test_monkeypatched_builtins_do_not_pass_or_leak(solo):
    code = """
import builtins, json
builtins.isinstance = lambda *a: True
builtins.type = lambda *a: int
builtins.len = lambda *a: 0
builtins.AssertionError = Exception
json.dumps = lambda *a, **k: '{"i": 0, "value": "patched"}'
def add(a, b):
    return 0
"""
    report = solo.judge(attempt(ADD, code))
    assert not report.verdict.passed and report.verdict.score == 0.0
    assert_clean_and_working(solo)  # the next attempt forks from an unpatched server


def test_attempts_cannot_ptrace_or_read_the_server(judge):
    task = make_task("peek", ["assert peek() == 'read the server'"])
    code = """
import os
def peek():
    for path in ('/proc/1/environ', '/proc/1/mem', '/proc/1/fd/0', '/proc/1/maps'):
        try:
            with open(path, 'rb') as f:
                f.read(16)
            return 'read the server'
        except OSError:
            pass
    return 'denied'
"""
    assert not judge(code, task).verdict.passed


def test_host_is_unchanged_after_attacks():
    """After a fork bomb and a daemon, closing the verifier leaves no sandbox process on the host.

    The sandbox's processes are found by its pid namespace (bwrap --unshare-all), which no process
    inside can leave: a surviving daemon would still be counted, and other suites' sandboxes running
    at the same time are not."""
    if BWRAP_PROBLEM is not None:
        pytest.skip(BWRAP_PROBLEM)
    v = PythonTestsVerifier(workers=1, test_timeout_s=0.5, attempt_timeout_s=2.0, max_processes=8)
    task = make_task("spawn", ["assert spawn() == 1"])
    code = ("import os, time\ndef spawn():\n    for _ in range(50):\n        try:\n"
            "            if os.fork() == 0:\n                os.setsid()\n                time.sleep(600)\n"
            "        except OSError:\n            pass\n    return 0\n")
    v.judge(attempt(task, code))
    bwrap = v.pool._all[0].proc.pid
    namespaces = {_pid_ns(pid) for pid in _live_processes() if _parent(pid) == bwrap} - {_pid_ns(os.getpid())}
    assert len(namespaces) == 1, namespaces  # the fork server, in the sandbox's own pid namespace
    inside = [pid for pid in _live_processes() if _pid_ns(pid) in namespaces]
    assert len(inside) == 1, inside  # only the server: the sleeping daemons died with the attempt
    v.close()
    time.sleep(0.1)
    assert not _alive(bwrap)
    assert [pid for pid in _live_processes() if _pid_ns(pid) in namespaces] == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _live_processes() -> list[int]:
    """Host pids of processes that are not zombies."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if _alive(pid):
                found.append(pid)
        except OSError:
            continue
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def test_signal_names_are_reported(judge):
    report = judge("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)\n", ADD)
    assert report.verdict.status is Status.CRASHED
    assert "SIGSEGV" in report.verdict.detail


def test_what_an_attempt_prints_never_reaches_the_verdict(judge):
    """A failing attempt prints what it found (here a marker; in an attack, whatever it could read): the verdict,
    which reaches samples.jsonl and with `-o turns>1` the model's repair prompt, carries the comparison only."""
    code = "import sys\ndef add(a, b):\n    print('PRINTED-MARKER', flush=True)\n    sys.stderr.write('STDERR-MARKER')\n    sys.stderr.flush()\n    return 0\n"
    report = judge(code, ADD)
    assert not report.verdict.passed and "returned 0" in report.verdict.detail
    assert "MARKER" not in report.verdict.detail and "PRINTED-MARKER" in report.output  # kept on the host only
