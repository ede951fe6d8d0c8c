"""The one set of sandbox rules every plugin uses for code a model wrote: a bubblewrap jail that also
starts where Modal runs it (gVisor).

Standard library only, and no import of vrl: the Lean re-check host (`vrl_lean/recheck_host.py`) runs
as a script inside the kimina-lean-server image, where vrl is not installed; copy this file beside it
(docs/plugins/lean.md). Callers add what is theirs (which paths to show, the uid, pid 1); this module
owns what must be the same everywhere:

- **Namespaces.** `--unshare-all`: its own user, pid, ipc, uts and cgroup namespaces, and its own
  network namespace where bubblewrap can make one. Under gVisor it cannot: bwrap's loopback set-up in
  a new network namespace fails there, because gVisor makes every new namespace with `lo` already up
  at 127.0.0.1 (`bwrap: loopback: Failed RTM_NEWADDR: File exists`; gVisor issue 13438 and bubblewrap
  issue 745, both open in 2026-12; gVisor's fix, PR 13471, was closed unmerged). The start-up probe
  (`probe`) then keeps the container's network namespace (`--share-net`; on Modal a sandbox with
  `block_network`), and says so.
- **No socket, on every kernel.** A seccomp filter (`seccomp_filter`) refuses socket(2) of every
  family and io_uring (which can open sockets itself): the code has no network, and no path or
  abstract Unix socket of the host either (docker.sock, a daemon's socket), whatever is mounted. So
  the guarantee does not depend on the network namespace. socketpair(2) stays: an unconnected pair
  reaches nothing outside.
- **No new user namespace**, by the same filter (clone/unshare with namespace flags, setns; clone3
  answers ENOSYS, as Docker's default profile does, so libc falls back to clone, whose flags a filter
  can read). Not bwrap's `--disable-userns`: it writes /proc/sys/user/max_user_namespaces, which gVisor
  does not have (gVisor issue 11210, open). Also refused: SysV IPC, POSIX message queues and keyrings
  (objects that would outlive an attempt or cross namespaces), ptrace and process_vm_* (the jail's
  other processes), bpf, perf_event_open, userfaultfd, pidfd_getfd.
- **Limits** (`Limits`, applied by `limited`): data segment (private writable memory: a Lean process
  maps Mathlib's .olean files read-only, which an address-space cap would count), CPU seconds, size of
  any file written, no core dumps; output read in chunks and capped (`run`).
- **Files read back from a job folder** are regular files opened without following links
  (`read_regular`).

What the jail shows of the host file system is the caller's list of read-only binds; `/` itself is
never bound, so home directories, /run's sockets and other jobs' folders (wherever TMPDIR is) do not
exist inside.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import platform
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

# -- seccomp -----------------------------------------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "riscv64": 0xC00000F3}
# Syscall numbers: x86_64 has its own table; aarch64 and riscv64 share the generic one.
_X86_64 = {
    "socket": 41, "shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "setns": 308, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "bpf": 321, "userfaultfd": 323, "perf_event_open": 298, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "pidfd_getfd": 438, "clone": 56, "clone3": 435,
}
_GENERIC = {
    "socket": 198, "shmget": 194, "semget": 190, "msgget": 186, "mq_open": 180, "add_key": 217, "request_key": 218,
    "keyctl": 219, "unshare": 97, "setns": 268, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
    "bpf": 280, "userfaultfd": 282, "perf_event_open": 241, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "pidfd_getfd": 438, "clone": 220, "clone3": 435,
}
SYSCALLS = {"x86_64": _X86_64, "aarch64": _GENERIC, "riscv64": _GENERIC}
DENIED = ("socket", "io_uring_setup", "io_uring_enter", "io_uring_register", "unshare", "setns", "shmget", "semget",
          "msgget", "mq_open", "add_key", "request_key", "keyctl", "ptrace", "process_vm_readv", "process_vm_writev",
          "bpf", "userfaultfd", "perf_event_open", "pidfd_getfd")
"""Refused with EPERM, whatever their arguments."""
# clone(2) flags that make a namespace (user, mount, cgroup, uts, ipc, pid, net): refused; a plain fork,
# vfork or thread passes. Only the low 32 bits of the first argument are read (the flags are an int).
CLONE_NAMESPACE_FLAGS = 0x10000000 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000


class Unavailable(ValueError):
    """The jail cannot run here; the message names bubblewrap and the cause. A ValueError, like other
    set-up problems, so a CLI reports it as one line."""


def seccomp_filter(machine: str | None = None) -> bytes:
    """The classic-BPF program `bwrap --seccomp FD` loads (see the module docstring for what it refuses)."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise Unavailable(f"bubblewrap's seccomp filter does not know this architecture ({machine}; known: "
                          f"{', '.join(_AUDIT_ARCH)})")
    nr = SYSCALLS[machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    ALLOW, DENY, NOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    # Layout, in order: arch check; nr checks jumping to DENY / NOSYS / CLONE; ALLOW; CLONE's flag test; DENY; NOSYS.
    denied = [nr[name] for name in DENIED]
    checks: list[tuple[int, int, str]] = []  # (op, k, target) for each test of the syscall number
    if machine == "x86_64":
        checks.append((JGE, 0x40000000, "deny"))  # x32 numbers: no Python or Lean here uses that ABI
    checks += [(JEQ, n, "deny") for n in denied]
    checks += [(JEQ, nr["clone3"], "nosys"), (JEQ, nr["clone"], "clone")]
    program: list[tuple[int, int, int, int]] = [(LD, 0, 0, 4)]  # seccomp_data.arch
    # A foreign calling convention (i386 `int 0x80` on x86_64) has other numbers: refuse it outright.
    program += [(JEQ, 1, 0, _AUDIT_ARCH[machine]), (RET, 0, 0, DENY), (LD, 0, 0, 0)]  # then seccomp_data.nr
    first_check = len(program)
    allow_at = first_check + len(checks)
    targets = {"clone": allow_at + 1, "deny": allow_at + 4, "nosys": allow_at + 5}
    for index, (op, k, target) in enumerate(checks):
        program.append((op, targets[target] - (first_check + index) - 1, 0, k))
    program.append((RET, 0, 0, ALLOW))
    program.append((LD, 0, 0, 16))  # clone: the low word of args[0] (little-endian on every architecture above)
    program.append((JSET, 1, 0, CLONE_NAMESPACE_FLAGS))  # any namespace flag: deny
    program.append((RET, 0, 0, ALLOW))
    program.append((RET, 0, 0, DENY))
    program.append((RET, 0, 0, NOSYS))
    assert len(program) == allow_at + 6
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in program)


def seccomp_fd() -> int:
    """A file descriptor holding `seccomp_filter()`, at its start, for `bwrap --seccomp FD` (pass it with
    `pass_fds`; close it once bwrap started)."""
    fd = os.memfd_create("vrl-seccomp", os.MFD_CLOEXEC)
    data = memoryview(seccomp_filter())
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -- bubblewrap --------------------------------------------------------------------------------------


def bwrap() -> str:
    """bwrap's absolute path (resolved by the host: a sandbox uid may not search every PATH entry)."""
    found = shutil.which("bwrap")
    if found is None:
        raise Unavailable("bubblewrap (`bwrap`) is not installed: install the Debian/Ubuntu package `bubblewrap` "
                          "(apt-get install bubblewrap; Fedora: dnf install bubblewrap)")
    return found


@dataclasses.dataclass(frozen=True)
class Probe:
    """What bubblewrap can do here: `network` is 'own' (a network namespace of the jail's own) or
    'shared' (gVisor: the container's, with sockets refused by seccomp alone); `note` says why."""

    network: str
    note: str = ""


_GVISOR_LOOPBACK = "loopback"  # bwrap's loopback_setup() error, the marker of gVisor's pre-configured lo


def probe() -> Probe:
    """Start the jail once per bwrap with `true` (about 10 ms) and learn which network rule holds;
    raises `Unavailable` naming the real cause when bubblewrap cannot make its namespaces at all."""
    if sys.platform != "linux":
        raise Unavailable(f"the bubblewrap sandbox needs Linux (this is {sys.platform})")
    return _probe(bwrap())


@functools.cache
def _probe(program: str) -> Probe:
    true = shutil.which("true") or "/bin/true"
    binds = [p for p in ("/usr", "/bin", "/lib", "/lib64", "/lib32") if os.path.exists(p)]
    first_error = ""
    for network in ("own", "shared"):
        argv = [program, *namespace_args(network)]
        for path in binds:
            argv += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
        fd = seccomp_fd()
        try:
            proc = subprocess.run([*argv, "--proc", "/proc", "--dev", "/dev", "--seccomp", str(fd), "--", true],
                                  capture_output=True, text=True, timeout=30, check=False, pass_fds=(fd,), cwd="/")
        except subprocess.TimeoutExpired:
            raise Unavailable("bubblewrap cannot create its sandbox here: it did not start within 30 s") from None
        finally:
            os.close(fd)
        if proc.returncode == 0:
            note = "" if network == "own" else (
                "bubblewrap cannot make a network namespace here (gVisor: `" + first_error + "`); the sandbox shares "
                "the container's, and seccomp refuses every socket")
            return Probe(network, note)
        error = proc.stderr.strip()[-300:] or f"exit code {proc.returncode}"
        if network == "own" and _GVISOR_LOOPBACK in error:
            first_error = error
            continue
        raise Unavailable(f"bubblewrap cannot create its sandbox here: {error}. {_hint(error)}")
    raise AssertionError("unreachable")


def _hint(error: str) -> str:
    if "seccomp" in error.lower():
        return "The kernel refused vrl's seccomp filter (bwrap --seccomp needs seccomp-bpf)."
    if "make / slave" in error:  # seen under runsc 20240729 (docs/modal.md, "Tried on a real gVisor")
        return ("Under gVisor this is a bug of releases before 20240923.0: clone() gave bubblewrap's new mount namespace "
                "the wrong owner (google/gvisor commit f229b3e); run on a newer gVisor")
    if "Function not implemented" in error:  # ENOSYS from the kernel, not a refusal
        return ("The kernel lacks a system call this bubblewrap needs: gVisor before release 20260831.0 has no openat2, "
                "which bubblewrap 0.12 built without its fallback requires (google/gvisor#14451); install a "
                "bubblewrap of 0.11 or older (Debian's), or run on a newer gVisor")
    return ("It needs unprivileged user namespaces: check `sysctl user.max_user_namespaces` (> 0), "
            "`kernel.unprivileged_userns_clone=1` (Debian) and `kernel.apparmor_restrict_unprivileged_userns=0` "
            "(Ubuntu 24.04+); inside Docker run with --security-opt seccomp=unconfined")


def self_check() -> str | None:
    """None when the jail starts here; else one line naming bubblewrap and the cause (for `check_ready`,
    `vrl modal doctor` and the re-check host's start)."""
    try:
        probe()
    except Unavailable as exc:
        return str(exc)
    return None


def namespace_args(network: str | None = None) -> list[str]:
    """The namespace flags of every jail (`network`: 'own' or 'shared'; default: what `probe` found)."""
    network = network or probe().network
    # --unshare-user as well: --unshare-all only tries one (a setuid bwrap would go on without it).
    argv = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    return argv + (["--share-net"] if network == "shared" else [])


USR_PARTS = ("/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/usr/share/zoneinfo")
"""The parts of /usr a program and its libraries need: programs, shared libraries (a Python's standard library
under lib/pythonX.Y) and time zones. Not /usr/share, /usr/local, /usr/src: data a deployment keeps there (task
files included) stays outside."""
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The top-level program and library folders (often symlinks into /usr, kept as symlinks)."""
_SYSTEM = (*USR_PARTS, *SYSTEM_DIRS)


def system_binds() -> list[str]:
    """bwrap arguments showing what any dynamically linked program needs: /usr's program and library
    folders and the top-level /bin, /lib... (symlinks kept as symlinks). Not /etc, /usr/local, /usr/share
    (time zones aside), /opt, /home, /root, /run, /var, /tmp."""
    argv: list[str] = []
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv


def program_roots(command: list[str], home: str | None = None) -> list[str]:
    """The folders a command's programs need, to bind read-only: for each absolute path in `command`
    (and the first word found on PATH), the installation above its `bin/` (a toolchain, a virtualenv,
    elan's home), or the file's own folder; symlinks followed to where they lead, and both kept.
    Never `/` or a home directory itself (then only the file): a toolchain under ~/.elan brings
    ~/.elan, not the rest of home."""
    home = os.path.realpath(home or os.environ.get("HOME") or "/root")
    paths: list[str] = []
    first = shutil.which(command[0]) if command else None
    for arg in ([first] if first else []) + list(command):
        if arg and os.path.isabs(arg) and os.path.exists(arg):
            paths += [arg, os.path.realpath(arg)]
    roots: list[str] = []
    for path in dict.fromkeys(paths):
        p = Path(path)
        root = p.parent.parent if p.parent.name == "bin" else p.parent
        if str(root) == "/" or os.path.realpath(root) in (home, "/home", "/root", "/tmp") or Path(home).is_relative_to(root):
            root = p
        roots.append(str(root))
    system = [p for p in _SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    roots = [r for r in roots if r != "/usr" and not any(Path(r).is_relative_to(s) for s in system)]
    return [r for r in dict.fromkeys(roots) if not any(r != o and Path(r).is_relative_to(o) for o in roots)]


# -- limits and running ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Limits:
    """rlimits for every process of a jail (inherited from bwrap): `memory_mb` caps the data segment
    (RLIMIT_DATA: private writable memory), `cpu_s` CPU seconds per process, `file_mb` the size of any
    file written, no core dumps; None leaves a limit as it is."""

    memory_mb: int | None = 8192
    cpu_s: int | None = None
    file_mb: int | None = 1024

    def rlimits(self) -> dict[str, int]:
        out = {"RLIMIT_CORE": 0}
        if self.memory_mb is not None:
            out["RLIMIT_DATA"] = self.memory_mb << 20
        if self.cpu_s is not None:
            out["RLIMIT_CPU"] = max(1, int(self.cpu_s))
        if self.file_mb is not None:
            out["RLIMIT_FSIZE"] = self.file_mb << 20
        return out


# A trusted launcher: sets the limits, then becomes bwrap (exec keeps the fds passed to it). Not
# `preexec_fn`, which is unsafe in a threaded host (the re-check runs in threads).
_LAUNCH = ("import json,os,resource,sys\n"
           "for k,v in json.loads(sys.argv[1]).items(): resource.setrlimit(getattr(resource,k),(v,v))\n"
           "os.execv(sys.argv[2],sys.argv[2:])")


def limited(argv: list[str], limits: Limits) -> list[str]:
    """`argv` (an absolute program first) run under `limits`."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCH, json.dumps(limits.rlimits()), *argv]


@dataclasses.dataclass
class Ran:
    """What a jailed process left: its exit code (None: killed at the deadline), the first `cap` bytes of
    each stream, and whether more was written (read and dropped, so the process never blocks)."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    elapsed_s: float

    def text(self) -> str:
        return (self.stdout + b"\n" + self.stderr).decode("utf-8", errors="replace")


def run(argv: list[str], *, cwd: str, timeout_s: float, env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (), cap: int = 64 << 10) -> Ran:
    """Run `argv` in a new session; read both streams in chunks, keeping `cap` bytes of each; kill the
    whole session at the deadline. The host never holds more than 2 x `cap` of its output."""
    start = time.monotonic()
    deadline = start + max(timeout_s, 0.001)
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env, pass_fds=pass_fds, close_fds=True)
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # stdout first, stderr second
    truncated = False
    killed = False
    with selectors.DefaultSelector() as sel:
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream.fileno(), selectors.EVENT_READ)
        open_fds = set(kept)
        exited_at: float | None = None
        while open_fds:
            now = time.monotonic()
            if now >= deadline and not killed:
                _kill_session(proc)
                killed = True
                deadline = now + 2.0  # read what is left, then stop whatever holds the pipes
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 1.0:
                break  # a process that outlived the jail's pid 1 holds the pipes: stop reading
            if killed and now >= deadline:
                break
            for key, _ in sel.select(timeout=min(0.2, max(0.0, deadline - now))):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
                    continue
                buf = kept[key.fd]
                room = cap - len(buf)
                if room < len(chunk):
                    truncated = True
                buf += chunk[:max(room, 0)]
    if not killed:
        try:  # both streams closed: it is exiting; wait for it, up to the deadline
            proc.wait(timeout=max(0.0, deadline - time.monotonic()) if not open_fds else 0.0)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            killed = True
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    out, err = kept.values()
    return Ran(None if killed else proc.returncode, bytes(out), bytes(err), truncated, time.monotonic() - start)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes, opened without
    following a symlink (in the last component: the folders above are the host's own) and without
    blocking on a FIFO. Raises OSError saying what it found otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{os.fspath(path)} is not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{os.fspath(path)} is larger than {limit} bytes")
        chunks = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"{os.fspath(path)} is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
