"""vrl's jail and the Modal emulator's gVisor rules for bubblewrap (tests/modal_emulator/gvisor.py), on a real
gVisor: runsc, run as `runsc --network=none do` (root).

The runsc is `scripts/gvisor`'s build (Debian sid's gVisor 20240729 with upstream's fix f229b3e and the Go
runtime offsets of its toolchain: about 2 minutes, once per machine, started by scripts/test), or `VRL_RUNSC`.
Where neither can be had (not root, no debootstrap, the build failed) every test skips with the reason. Modal
runs a newer gVisor than this build (docs/modal.md, "Tried on a real gVisor"): these tests check the rules a
stand-in enforces and the jail's guarantees on a real gVisor kernel, not all of Modal's.

- rule 1 (a network namespace bwrap makes fails in its loopback set-up; google/gvisor#13438): the real
  refusal and the emulator's share bwrap's own message up to the errno (`loopback: Failed RTM_NEWADDR`), the
  part vrl's jail keys on;
- rule 2's cause (no /proc/sys/user/max_user_namespaces, which `--disable-userns` writes; google/gvisor#11210);
- the jail starts there, falls back to the sandbox's network as the emulator predicts, and keeps every
  guarantee tests/test_jail.py checks on Linux: no socket, no new namespace, processes and threads work,
  nothing of the host's files but the binds;
- the python-tests verifier judges there, and what an attempt tries against it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_jail import assert_jailed

REPO = Path(__file__).parents[1]
EMULATED = Path(__file__).parent / "fixtures" / "gvisor" / "bwrap"
GVISOR = REPO / "scripts" / "gvisor"
LOOPBACK = "bwrap: loopback: Failed RTM_NEWADDR"
BUILD_WAIT_S = 420


def _where() -> dict[str, str]:
    out = subprocess.run([str(GVISOR), "where"], capture_output=True, text=True, timeout=60).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def _check() -> str:
    """Why these tests cannot run here (instant: at collection, on every worker), or '' when they may."""
    if shutil.which("bwrap") is None:
        return "no bwrap on PATH"
    if os.environ.get("VRL_RUNSC"):
        out = subprocess.run([os.environ["VRL_RUNSC"], "--version"], capture_output=True, text=True, timeout=30).stdout
        found = re.search(r"(20\d{6})", out)
        if found and int(found.group(1)) < 20240729:
            return f"VRL_RUNSC's {out.split(chr(10))[0]!r} is older than 20240729 (it cannot run bwrap at all)"
        return ""
    if os.geteuid() != 0:
        return "runsc do needs root"
    where = _where()
    return where["REASON"] if where["STATE"] == "cannot" else ""


WHY = _check()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY)


@pytest.fixture(scope="module")
def runsc() -> tuple[str, bool]:
    """(runsc's path, whether it is scripts/gvisor's build); builds it here (or waits for scripts/test's build
    under way) when it is not built yet. A build that failed skips with its log, and is not retried here: it
    depends on Debian sid's packages of the day, not on vrl's code."""
    if os.environ.get("VRL_RUNSC"):
        return os.environ["VRL_RUNSC"], False
    where = _where()
    if where["STATE"] == "failed" and where["BUSY"] != "1":  # retried by scripts/test or by hand, not here
        pytest.skip(f"the gVisor build failed (log: {where['LOG']}); scripts/gvisor build retries it")
    try:  # about 2 minutes on the 2-core machine; a slow mirror must not hold a test worker for long
        build = subprocess.run([str(GVISOR), "build"], capture_output=True, text=True, timeout=BUILD_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"the gVisor build did not finish within {BUILD_WAIT_S} s; run scripts/gvisor build")
    if build.returncode != 0:
        pytest.skip(f"the gVisor build failed: {build.stderr.strip()[-500:]}")
    return build.stdout.strip(), True


def under_gvisor(runsc: tuple[str, bool], *argv: str) -> subprocess.CompletedProcess:
    """`argv` run by `runsc do`; tried again (3 tries) when runsc itself dies, exit 2 with nothing written:
    Debian's own 20240729 build (given by VRL_RUNSC) panics now and then (`assertTaskGoroutine`), whatever the
    program does; scripts/gvisor's build, with the toolchain's runtime offsets, does not."""
    for _ in range(3 if not runsc[1] else 1):
        res = subprocess.run([runsc[0], "--network=none", "do", *argv], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        if not (res.returncode == 2 and not res.stdout and not res.stderr):
            return res
    return res


def test_the_emulated_loopback_refusal_is_the_real_one_up_to_the_errno(runsc):
    bwrap = shutil.which("bwrap")
    real = under_gvisor(runsc, bwrap, "--ro-bind", "/", "/", "--unshare-net", "/bin/true")
    emulated = subprocess.run([str(EMULATED), "--ro-bind", "/", "/", "--unshare-net", "/bin/true"],
                              capture_output=True, text=True, timeout=60)
    assert real.returncode != 0 and LOOPBACK in real.stderr, real.stderr
    assert emulated.returncode != 0 and LOOPBACK in emulated.stderr, emulated.stderr
    # bwrap itself runs there (a shell inside it crashes the 20240729 Debian build's sentry every time)
    ok = under_gvisor(runsc, bwrap, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-ipc", "/bin/echo", "ran")
    assert ok.returncode == 0 and ok.stdout.strip() == "ran", ok.stdout + ok.stderr


def test_gvisor_has_no_max_user_namespaces_which_disable_userns_writes(runsc):
    res = under_gvisor(runsc, "/bin/sh", "-c", "test -e /proc/sys/user/max_user_namespaces && echo present || echo absent")
    assert res.stdout.strip() == "absent", res.stdout + res.stderr
    assert Path("/proc/sys/user/max_user_namespaces").exists()  # as on Linux: the rule is gVisor's


def test_the_jail_starts_under_gvisor_and_keeps_its_guarantees(runsc):
    """The jail's own probe and tests/test_jail.py's probe of its rules, run inside the jail inside runsc. A runsc
    before 20240923 (Debian's, say, by VRL_RUNSC) refuses every bwrap user namespace (gVisor bug f229b3e): then
    the jail must refuse in one line naming bubblewrap's error and the cause, never start half a sandbox."""
    script = ("import json, os, sys\nsys.path[:0] = [%r, %r]\nfrom vrl import jail\n"
              "try:\n    found = jail.probe()\nexcept jail.Unavailable as exc:\n"
              "    print(json.dumps({'refused': str(exc)})); raise SystemExit\n"
              "import test_jail\n"
              "proc = test_jail.jailed([test_jail.PYTHON, '-I', '-c', test_jail.PROBE,"
              " json.dumps(jail.SYSCALLS[os.uname().machine])])\n"
              "print(json.dumps({'network': found.network, 'note': found.note, 'rc': proc.returncode,"
              " 'err': proc.stderr[-400:], 'out': json.loads(proc.stdout) if proc.returncode == 0 else None}))\n"
              ) % (str(REPO), str(REPO / "tests"))
    res = under_gvisor(runsc, sys.executable, "-I", "-c", script)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and len(lines) == 1, res.stdout + res.stderr
    got = json.loads(lines[0])
    if "refused" in got:
        assert not runsc[1], got  # scripts/gvisor's build has the fix
        assert got["refused"].startswith("bubblewrap cannot create its sandbox here: bwrap: Failed to make / slave")
        assert "f229b3e" in got["refused"]
        return
    assert got["network"] == "shared" and "gVisor" in got["note"] and "RTM_NEWADDR" in got["note"], got
    assert got["rc"] == 0, got["err"]
    assert_jailed(got["out"])  # the same facts as on Linux


VERIFIER_UNDER_GVISOR = r"""
import json, os, socket, sys, tempfile
from vrl import jail
from vrl.types import Attempt, Completion
from vrl_python_tests.datasets import to_tasks
from vrl_python_tests.verifier import PythonTestsVerifier

def judge(v, entry, tests, code):
    row = {"id": entry, "text": "t", "entry_point": entry, "tests": tests, "hidden_tests": []}
    task = to_tasks([("inline", row)], "vrl")[0]
    return v.judge(Attempt(task=task, completion=Completion(task_id=task.id, text=code))).verdict.status.value

listener = socket.socket()
listener.bind(("127.0.0.1", 0)); listener.listen(1); listener.settimeout(0.3)
port = listener.getsockname()[1]
secret = os.path.join(tempfile.mkdtemp(), "secret.txt")
open(secret, "w").write("host-secret-7731")
reach = (
    "import socket\n"
    "def reach(port):\n"
    "    s = socket.socket(); s.settimeout(0.3)\n"
    "    try:\n        s.connect(('127.0.0.1', port)); s.sendall(b'pwned'); return 'reached'\n"
    "    except OSError as e:\n        return str(e)\n")
read = "def read(path):\n    try:\n        return open(path).read()\n    except OSError as e:\n        return str(e)\n"
v = PythonTestsVerifier(workers=1, test_timeout_s=2.0, attempt_timeout_s=8.0, memory_mb=256, max_processes=8)
try:
    out = {
        "network": jail.probe().network,
        "correct": judge(v, "add", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "def add(a, b):\n    return a + b\n"),
        "wrong": judge(v, "add", ["assert add(1, 2) == 3"], "def add(a, b):\n    return a - b\n"),
        "exit_0": judge(v, "add", ["assert add(1, 2) == 3"], "import os\nos._exit(0)\n"),
        "socket": judge(v, "reach", [f"assert reach({port}) == 'reached'"], reach),
        "host_file": judge(v, "read", [f"assert read({secret!r}) == 'host-secret-7731'"], read),
    }
finally:
    v.close()
try:
    listener.accept()
    out["reached"] = True
except socket.timeout:
    out["reached"] = False
print(json.dumps(out))
"""


def test_the_python_tests_verifier_judges_and_contains_attempts_under_gvisor(runsc):
    """The python-tests plugin's verifier (its sandboxes in vrl's jail) inside a real gVisor, as on Modal: a
    right answer passes; a wrong one, one that exits 0 before any test, one that reaches a listener of the
    verify server's network namespace (shared with the jail under gVisor: only seccomp stands between them) and
    one that reads a file of the server's do not, and the listener is never reached."""
    if not runsc[1]:  # another runsc (VRL_RUNSC) may refuse every jail: the previous test checks that refusal
        probe = under_gvisor(runsc, sys.executable, "-I", "-c", "from vrl import jail; print(jail.self_check())")
        if probe.stdout.strip() != "None":
            pytest.skip(f"the jail does not start under this runsc: {probe.stdout.strip()[:200]}")
    res = under_gvisor(runsc, sys.executable, "-I", "-c", VERIFIER_UNDER_GVISOR)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, res.stdout + res.stderr[-2000:]
    got = json.loads(lines[-1])
    # Each its own verdict, not a crash of the sandbox: before the server waited on SIGCHLD where pidfd_open is
    # missing, every attempt after a sandbox's first "crashed" under this gVisor.
    assert got == {"network": "shared", "correct": "passed", "wrong": "failed", "exit_0": "crashed",
                   "socket": "failed", "host_file": "failed", "reached": False}, got
