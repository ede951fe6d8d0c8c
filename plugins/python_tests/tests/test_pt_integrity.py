"""Verifier integrity, round 2: attacks found by an independent attack run, each through the real sandbox.

Every test drives the attack through bubblewrap, the fork server and the host-side comparison, and is
built so that it would fail if the hole were open: the planting attempt's leftovers would show in the
probe, the stealer would return the hidden value it was asked for, a batch would raise or lose its
good neighbours, a forged set would be decoded instead of refused, `1` would pass `is True`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import attempt, make_task, needs_bwrap, sandboxed
from vrl_python_tests.datasets import bundled_path
from vrl_python_tests.sandbox import pick_python, visible_paths
from vrl_python_tests.verifier import PythonTestsVerifier

from vrl.types import Status

pytestmark = needs_bwrap

PLUGIN_DIR = Path(__file__).resolve().parents[1]
SCRATCH = ["/dev/shm", "/tmp"]


@pytest.fixture(scope="module")
def solo():
    """One sandbox, so each probe lands in the container the attack before it used."""
    yield from sandboxed(workers=1, test_timeout_s=20.0, attempt_timeout_s=40.0, memory_mb=256, max_processes=8)


# -- 1. nothing survives an attempt; the root is read-only; scratch is bounded ----------------------

WALK = """
import os
def _writable_dirs():
    found = []
    for top, dirs, _ in os.walk('/'):
        if top == '/':
            dirs[:] = [d for d in dirs if d != 'proc']  # per-process files; they die with the attempt
        probe = os.path.join(top, '.vrl-write-probe')
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError:
            continue
        os.unlink(probe)
        found.append(top)
    return sorted(found)
"""

WRITABLE = make_task("writable", [f"assert writable() == {SCRATCH!r}"])
WRITABLE_CODE = WALK + """
def writable():
    return _writable_dirs()
"""

IPC = """
import ctypes, os
_libc = ctypes.CDLL(None, use_errno=True)
_KEYCTL = {'x86_64': 250, 'aarch64': 219, 'riscv64': 219}.get(os.uname().machine)
_ADD_KEY = {'x86_64': 248, 'aarch64': 217, 'riscv64': 217}.get(os.uname().machine)
"""

PLANT = make_task("plant", ["assert plant() == []"])
PLANT_CODE = WALK + IPC + """
def plant():
    # Files everywhere writable, as large as allowed, in nested and locked directories.
    for top in _writable_dirs():
        for name in ('planted', 'sub/planted', 'sub/deeper/planted'):
            path = os.path.join(top, name)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, 'wb') as f:
                    for _ in range(8):
                        f.write(b'x' * (1 << 20))
            except OSError:
                pass
        try:
            os.chmod(os.path.join(top, 'sub'), 0)
        except OSError:
            pass
    for path in ('/etc/passwd', '/etc/hosts', '/home/vrl/planted', '/planted'):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                f.write('root:x:0:0:planted:/root:/bin/sh\\n')
        except OSError:
            pass
    made = []
    # SysV shared memory (512 MiB, touched), message queue, semaphores; a POSIX message queue; keys.
    shm = _libc.shmget(0x5652, 512 << 20, 0o1666)
    if shm >= 0:
        made.append('shm')
        _libc.shmat.restype = ctypes.c_void_p
        addr = _libc.shmat(shm, None, 0)
        if addr not in (None, ctypes.c_void_p(-1).value):
            ctypes.memset(addr, 1, 512 << 20)
            _libc.shmdt(ctypes.c_void_p(addr))
    if _libc.msgget(0x5652, 0o1666) >= 0:
        made.append('msg')
    if _libc.semget(0x5652, 4, 0o1666) >= 0:
        made.append('sem')
    try:
        mq_open = _libc.mq_open
    except AttributeError:
        mq_open = ctypes.CDLL('librt.so.1', use_errno=True).mq_open
    if mq_open(b'/vrl-planted', os.O_CREAT | os.O_RDWR, 0o666, None) >= 0:
        made.append('mqueue')
    for ring in (-4, -3, -5):  # user, session, user session keyring
        if _libc.syscall(_ADD_KEY, b'user', b'vrl-planted', b'secret', 6, ring) >= 0:
            made.append(f'key{ring}')
    return made
"""

PROBE = make_task("probe", ["assert probe() == {'files': [], 'used_kib': [0, 0], 'size_mib': [16, 16], "
                            "'planted_elsewhere': [], 'sysvipc': [], 'mqueue': False, 'keys': []}"])
PROBE_CODE = WALK + IPC + """
def probe():
    files = []
    for top in _writable_dirs():
        for root, dirs, names in os.walk(top):
            files += [os.path.join(root, n) for n in dirs + names]
    stats = [os.statvfs(d) for d in ('/dev/shm', '/tmp')]
    planted = [p for p in ('/etc/passwd', '/etc/hosts', '/home/vrl/planted', '/planted') if os.path.exists(p)]
    sysvipc = []
    for kind in ('shm', 'msg', 'sem'):
        with open('/proc/sysvipc/' + kind) as f:
            sysvipc += [kind + ': ' + line.strip() for line in f.readlines()[1:]]
    try:
        mq_open = _libc.mq_open
    except AttributeError:
        mq_open = ctypes.CDLL('librt.so.1', use_errno=True).mq_open
    try:
        with open('/proc/keys') as f:
            keys = [line.strip() for line in f if 'vrl-planted' in line]
    except FileNotFoundError:  # a kernel without keyrings
        keys = []
    return {'files': sorted(files),
            'used_kib': [(s.f_blocks - s.f_bfree) * s.f_frsize >> 10 for s in stats],
            'size_mib': [s.f_blocks * s.f_frsize >> 20 for s in stats],
            'planted_elsewhere': planted, 'sysvipc': sysvipc,
            'mqueue': mq_open(b'/vrl-planted', os.O_RDONLY, 0, None) >= 0, 'keys': keys}
"""


def test_only_tmp_and_dev_shm_are_writable(solo):
    """Every directory of the sandbox's file system is tried: the root and /dev are read-only."""
    report = solo.judge(attempt(WRITABLE, WRITABLE_CODE))
    assert report.verdict.passed, report.verdict.detail


def test_an_attempt_leaves_nothing_for_the_next(solo):
    """A planter fills every writable place and tries every IPC store; the next attempt finds nothing.

    The probe checks every writable directory (found by trying them all, not a fixed list), the size
    and use of both scratch mounts (what host memory the sandbox can hold between attempts), planted
    system files, SysV IPC, a POSIX message queue and keys; with the probe's own sizes in its task,
    it would fail on any leftover.
    """
    planter = solo.judge(attempt(PLANT, PLANT_CODE))
    assert planter.verdict.passed, planter.verdict.detail  # every IPC object and key was refused
    probe = solo.judge(attempt(PROBE, PROBE_CODE))
    assert probe.verdict.passed, probe.verdict.detail
    assert solo.judge(attempt(WRITABLE, WRITABLE_CODE)).verdict.passed


def test_a_planted_passwd_does_not_change_what_a_later_attempt_sees(solo):
    task = make_task("who", ["assert who() == 'nobody known'"])
    code = """
import pwd
def who():
    try:
        return pwd.getpwuid(0).pw_gecos
    except KeyError:
        return 'nobody known'
"""
    before = solo.judge(attempt(task, code))
    assert before.verdict.passed, before.verdict.detail  # no /etc/passwd in the sandbox at all
    solo.judge(attempt(PLANT, PLANT_CODE))
    after = solo.judge(attempt(task, code))
    assert after.verdict.passed, after.verdict.detail  # not 'planted'


# -- 2. hidden tests are not readable, with the plugin installed under the interpreter's prefix ------

STEAL = """
import json, os
def steal(marker):
    for top, dirs, names in os.walk('/'):
        if top == '/':
            dirs[:] = [d for d in dirs if d != 'proc']
        for name in names:
            if not name.endswith(('.jsonl', '.json')):
                continue
            try:
                with open(os.path.join(top, name), errors='replace') as f:
                    text = f.read(1 << 22)
            except OSError:
                continue
            for line in text.splitlines():
                if marker in line:
                    row = json.loads(line)
                    return row['hidden_tests'][0]
    return 'not found'
"""


@pytest.fixture(scope="module")
def prefix_with_plugin():
    """A venv made with --copies from the sandbox's interpreter, the plugin pip-installed (non-editable)
    into its site-packages: the layout of a system, Docker or conda Python with vrl-python-tests in it.
    World-readable, because the sandbox runs under its own unprivileged uid."""
    base = pick_python(None, "bwrap")
    root = Path(tempfile.mkdtemp(prefix="vrl-prefix-", dir="/var/tmp"))  # /tmp is the sandbox's own scratch
    try:
        root.chmod(0o755)
        subprocess.run([base, "-m", "venv", "--copies", "--without-pip", str(root)], check=True, capture_output=True)
        python = root / "bin" / "python3"
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "--target", site, str(PLUGIN_DIR)], check=True, capture_output=True)
        for path in [root, *root.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
        installed = Path(site) / "vrl_python_tests" / "data" / "tasks.jsonl"
        assert installed.is_file(), "the non-editable install did not ship the task data"
        yield python, installed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _first_task(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


def test_hidden_tests_are_not_readable_when_the_plugin_is_installed_under_the_prefix(prefix_with_plugin):
    python, installed = prefix_with_plugin
    row = _first_task(installed)
    # The stealer is asked for the bundled task's first hidden test; it passes only if it finds the file.
    task = make_task("steal", [f"assert steal({row['id']!r}) == {row['hidden_tests'][0]!r}"])
    binds, _, masks = visible_paths(str(python))
    assert any(installed.is_relative_to(m) for m in masks), (binds, masks)
    v = PythonTestsVerifier(workers=1, python=str(python), test_timeout_s=10.0, attempt_timeout_s=20.0)
    try:
        report = v.judge(attempt(task, STEAL))
        sanity = v.judge(attempt(make_task("exe", ["assert exe() == 'x'"]),
                                 "import sys\ndef exe():\n    return sys.executable\n"))
    finally:
        v.close()
    assert report.tests[0].status == "wrong", report.verdict.detail
    assert "returned 'not found'" in report.tests[0].message
    assert f"returned {str(python)!r}" in sanity.tests[0].message  # it really ran the prefix's interpreter


def test_hidden_tests_are_not_readable_with_the_default_interpreter(solo):
    row = _first_task(bundled_path())
    task = make_task("steal", [f"assert steal({row['id']!r}) == {row['hidden_tests'][0]!r}"])
    report = solo.judge(attempt(task, STEAL))
    assert "returned 'not found'" in report.tests[0].message, report.verdict.detail


# -- 3, 4. a hostile value costs its own test, never the batch, and its decoding is bounded ----------

def forge(value_expr: str) -> str:
    """An attempt that writes `{"i": 0, "value": <JSON text of value_expr>}` on every descriptor, then exits.

    The line claims to be test 0's result: the host reads it as the returned value. Every open
    descriptor, not a fixed range: the result channel keeps the host's number, which is above 63
    when the host process has many files open (a long test session)."""
    return f"""
import os
def f():
    line = ('{{"i": 0, "value": ' + {value_expr} + '}}\\n').encode()
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd < 3:
            continue
        try:
            os.write(fd, line)
        except OSError:
            pass
    os._exit(0)
"""


# ~0.9 MB: 35,000 distinct ints with one hash value (multiples of 2**61 - 1); about 10 s of host CPU to
# build the set before, with the GIL held.
COLLIDING = "'{\"set\": [' + ', '.join(str(k * (2**61 - 1)) for k in range(1, 35_000)) + ']}'"


@pytest.mark.parametrize("code, reason", [
    ("def f():\n    return 10 ** 400\n", "returned 1000"),  # math.isclose(huge int, float): OverflowError
    (forge("""'{"complex": [' + '9' * 400 + ', 0]}'"""), "complex parts must be floats"),
    (forge(COLLIDING), "share one hash value"),
    (forge("""'{"list": [' * 320 + '1' + ']}' * 320"""), "nested deeper than"),
    (forge("'1' + '0' * 5000"), "more than 4300 digits"),
    (forge("""'{"set": [{"list": [1]}]}'"""), "unhashable"),
], ids=["isclose-overflow", "complex-overflow", "hash-collisions", "deep-nesting", "huge-int", "unhashable"])
def test_a_hostile_value_fails_its_attempt_and_spares_the_batch(verifier, code, reason):
    task = make_task("f", ["assert math.isclose(f(), 2.5)"])
    good = "def f():\n    return 2.5\n"
    batch = [attempt(task, good), attempt(task, code), attempt(task, good)]
    verdicts = asyncio.run(verifier.verify(batch))
    assert [v.passed for v in verdicts] == [True, False, True], [v.detail for v in verdicts]
    assert verdicts[1].status in (Status.FAILED, Status.CRASHED)
    assert reason in verdicts[1].detail, verdicts[1].detail


def test_an_equality_task_with_a_huge_int_is_judged_exactly(judge):
    task = make_task("big", [f"assert big() == {10 ** 400}"])
    assert judge("def big():\n    return 10 ** 400\n", task).verdict.passed
    assert not judge("def big():\n    return 10 ** 400 + 1\n", task).verdict.passed
    # math.isclose converts to float: Python's assert raises OverflowError, so the test fails here too.
    task = make_task("big", [f"assert math.isclose(big(), {10 ** 400})"])
    assert not judge("def big():\n    return 10 ** 400\n", task).verdict.passed


# -- 5. identity asserts stay identity checks ------------------------------------------------------

@pytest.mark.parametrize("expected, returned, passes", [
    ("True", "1", False), ("False", "0", False), ("None", "0", False), ("True", "1.0", False),
    ("True", "True", True), ("False", "False", True), ("None", "None", True),
])
def test_is_true_false_none_are_identity_checks(judge, expected, returned, passes):
    task = make_task("f", [f"assert f(1) is {expected}"])
    report = judge(f"def f(x):\n    return {returned}\n", task)
    assert report.verdict.passed is passes, report.verdict.detail
    if not passes:
        assert "identity check" in report.verdict.detail


def test_usr_is_not_bound_whole_and_only_package_dirs_are_masked():
    """Only the parts of /usr an interpreter needs are bound; masks cover package directories only."""
    binds, _, masks = visible_paths(pick_python(None, "bwrap"))
    assert "/usr" not in binds and "/usr/local" not in binds and "/usr/share" not in binds
    for m in masks:
        assert os.path.basename(m) in ("site-packages", "dist-packages", "vrl_python_tests"), m
