"""vrl's jail (`vrl.jail`), the sandbox rules every plugin shares, run for real: real bubblewrap, the
real seccomp filter, real rlimits. Each rule is checked in both set-ups the jail has: a network
namespace of its own (Linux), and the host's network namespace under gVisor's rules for bubblewrap,
acted out by `tests/fixtures/gvisor/bwrap` (the stand-in refuses what gVisor refuses, citing the trackers;
tests/test_gvisor_real.py checks its rules against a real runsc where one is installed)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vrl import jail

GVISOR = Path(__file__).parent / "fixtures" / "gvisor"
PROBLEM = jail.self_check()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"needs a working bubblewrap: {PROBLEM}")
PYTHON = "/usr/bin/python3"

# Run inside the jail: what each refused or allowed operation gives (an errno, or 0 when it worked).
PROBE = r"""
import ctypes, json, os, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def errno_of(fn):
    try:
        fn()
        return 0
    except OSError as exc:
        return exc.errno
def raw(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return ctypes.get_errno() if r == -1 else 0
for name, family in (("inet", socket.AF_INET), ("inet6", socket.AF_INET6), ("unix", socket.AF_UNIX),
                     ("netlink", socket.AF_NETLINK)):
    out[name] = errno_of(lambda: socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_STREAM))
out["socketpair"] = errno_of(socket.socketpair)
nr = json.loads(sys.argv[1])
out["unshare_user"] = raw(nr["unshare"], 0x10000000)
out["clone_newuser"] = raw(nr["clone"], 0x10000000 | 17, 0, 0, 0, 0)   # CLONE_NEWUSER | SIGCHLD
out["clone_newnet"] = raw(nr["clone"], 0x40000000 | 17, 0, 0, 0, 0)
out["clone3"] = raw(nr["clone3"], 0, 0)
out["io_uring_setup"] = raw(nr["io_uring_setup"], 1, 0)
out["keyctl"] = raw(nr["keyctl"], 0, 0)
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["subprocess"] = subprocess.run(["/bin/echo", "hi"], capture_output=True, text=True).stdout.strip()
seen = []
t = threading.Thread(target=seen.append, args=(1,)); t.start(); t.join()
out["thread"] = seen
out["root"] = sorted(os.listdir("/"))
print(json.dumps(out))
"""


def jailed(argv: list[str], network: str | None = None, **kw) -> subprocess.CompletedProcess:
    fd = jail.seccomp_fd()
    try:
        box = [jail.bwrap(), *jail.namespace_args(network), *jail.system_binds(), "--proc", "/proc", "--dev", "/dev",
               "--tmpfs", "/tmp", "--seccomp", str(fd), "--"]
        return subprocess.run([*box, *argv], capture_output=True, text=True, pass_fds=(fd,), timeout=60, cwd="/", **kw)
    finally:
        os.close(fd)


def assert_jailed(out: dict) -> None:
    """What PROBE reports from inside the jail: every refused operation refused, the allowed ones working, no
    host folder beyond the binds (also asserted inside a real gVisor: tests/test_gvisor_real.py)."""
    for refused in ("inet", "inet6", "unix", "netlink", "unshare_user", "clone_newuser", "clone_newnet",
                    "io_uring_setup", "keyctl"):
        assert out[refused] == errno.EPERM, (refused, out)
    assert out["clone3"] == errno.ENOSYS  # libc then falls back to clone, whose flags the filter reads
    assert (out["socketpair"], out["fork"], out["subprocess"], out["thread"]) == (0, 7, "hi", [1])
    assert not {"home", "root", "etc", "run", "var", "work", "opt"} & set(out["root"])


@pytest.fixture
def gvisor(monkeypatch):
    """bwrap as Modal's gVisor lets it run, for this test."""
    monkeypatch.setenv("PATH", f"{GVISOR}:{os.environ['PATH']}")


@needs_bwrap
@pytest.mark.parametrize("kernel", ["linux", "gvisor"])
def test_no_socket_no_namespace_but_processes_and_threads_work(kernel, request):
    if kernel == "gvisor":
        request.getfixturevalue("gvisor")
    found = jail.probe()
    assert found.network == ("own" if kernel == "linux" else "shared")
    if kernel == "gvisor":
        assert "gVisor" in found.note and "RTM_NEWADDR" in found.note
    # A host listener the jail would reach if it had a socket (under gVisor's rules it shares the namespace).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    try:
        proc = jailed([PYTHON, "-I", "-c", PROBE, json.dumps(jail.SYSCALLS[os.uname().machine])])
        assert proc.returncode == 0, proc.stderr
        assert_jailed(json.loads(proc.stdout))
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_gvisor_stand_in_refuses_what_gvisor_refuses(gvisor):
    """The stand-in itself: bwrap's own words for gVisor's two refusals, the real bwrap otherwise."""
    def bwrap(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bwrap", *args, "--ro-bind", "/", "/", "true"], capture_output=True, text=True, timeout=30)
    assert "loopback: Failed RTM_NEWADDR: File exists" in bwrap("--unshare-net").stderr
    assert "loopback: Failed RTM_NEWADDR: File exists" in bwrap("--unshare-all").stderr
    assert "/proc/sys/user/max_user_namespaces" in bwrap("--unshare-user", "--disable-userns").stderr
    if PROBLEM is None:
        assert bwrap("--unshare-all", "--share-net").returncode == 0


def test_a_bwrap_that_cannot_make_namespaces_is_named_with_its_cause(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    why = jail.self_check()
    assert why is not None and why.startswith("bubblewrap cannot create its sandbox here: bwrap: No permissions")
    assert "user namespaces" in why
    for line, hint in (("bwrap: Failed to make / slave: Operation not permitted", "f229b3e"),  # runsc < 20240923
                       ("bwrap: Can't mkdir parents for /tmp: Function not implemented", "openat2")):  # gvisor#14451
        jail._probe.cache_clear()
        fake.write_text(f'#!/bin/sh\necho "{line}" >&2\nexit 1\n')
        why = jail.self_check()
        assert why.startswith(f"bubblewrap cannot create its sandbox here: {line}.") and hint in why, why
        assert "user namespaces" not in why  # not the advice for a Linux without them
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "not installed" in jail.self_check()


def test_the_filter_is_built_for_each_known_architecture_and_refuses_others():
    sizes = {m: len(jail.seccomp_filter(m)) for m in ("x86_64", "aarch64", "riscv64")}
    assert all(size % 8 == 0 and size > 8 * len(jail.DENIED) for size in sizes.values())
    with pytest.raises(jail.Unavailable, match="architecture"):
        jail.seccomp_filter("mips")


def test_run_caps_output_and_kills_the_whole_session_at_the_deadline(tmp_path):
    flood = [sys.executable, "-c", "import sys\nfor _ in range(400): sys.stdout.write('x' * 65536)\nsys.stderr.write('e')"]
    ran = jail.run(flood, cwd=str(tmp_path), timeout_s=30, cap=1000)
    assert (ran.returncode, len(ran.stdout), ran.stderr, ran.truncated) == (0, 1000, b"e", True)
    marker = tmp_path / "child-alive"
    sleeper = [sys.executable, "-c", f"import os,time,subprocess\nsubprocess.Popen(['sh','-c','sleep 2; touch {marker}'])\n"
               "print('started', flush=True)\ntime.sleep(60)"]
    t0 = time.monotonic()
    ran = jail.run(sleeper, cwd=str(tmp_path), timeout_s=0.5)
    assert ran.returncode is None and ran.stdout.startswith(b"started") and time.monotonic() - t0 < 10
    time.sleep(2.5)
    assert not marker.exists()  # the child in the same session died with it


def test_limits_bound_memory_and_file_size(tmp_path):
    code = ("import sys\ntry:\n    b = bytearray(300 << 20)\n    print('allocated')\nexcept MemoryError:\n    print('refused')\n"
            "try:\n    open('big', 'wb').write(b'x' * (3 << 20))\n    print('written')\nexcept OSError as e:\n    print('efbig', e.errno)")
    argv = jail.limited([sys.executable, "-I", "-c", code], jail.Limits(memory_mb=200, file_mb=1))
    ran = jail.run(argv, cwd=str(tmp_path), timeout_s=30)
    assert ran.stdout.decode().split() == ["refused", "efbig", str(errno.EFBIG)], ran.text()
    ran = jail.run(jail.limited([sys.executable, "-I", "-c", code], jail.Limits(memory_mb=1024, file_mb=8)),
                   cwd=str(tmp_path), timeout_s=30)
    assert ran.stdout.decode().split() == ["allocated", "written"], ran.text()


def test_read_regular_refuses_links_fifos_and_oversize(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ok").write_bytes(b"12345")
    assert jail.read_regular(tmp_path / "ok", 5) == b"12345"
    with pytest.raises(OSError) as link:
        jail.read_regular(tmp_path / "link", 100)
    assert link.value.errno == errno.ELOOP
    with pytest.raises(OSError, match="not a regular file"):
        jail.read_regular(tmp_path / "fifo", 100)  # returns at once: never blocks on a writer
    with pytest.raises(OSError, match="larger than 4 bytes"):
        jail.read_regular(tmp_path / "ok", 4)


def test_program_roots_bring_a_toolchain_not_a_home(tmp_path):
    home = tmp_path / "home"
    elan = home / ".elan" / "bin"
    elan.mkdir(parents=True)
    (elan / "lake").write_text("#!/bin/sh\n")
    script = home / "fake_lean.py"
    script.write_text("")
    roots = jail.program_roots([str(elan / "lake"), "env", str(script)], home=str(home))
    assert roots == [str(home / ".elan"), str(script)]
    assert jail.program_roots(["/usr/bin/python3"]) == []  # /usr/bin is bound already
