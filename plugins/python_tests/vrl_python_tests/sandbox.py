"""Warm sandboxes that run untrusted Python: bubblewrap around the fork server in `harness.py`.

One `Sandbox` is one long-lived bubblewrap container (no network, no host files, a clean
environment, read-only system directories, small private tmpfs, its own pid and user namespaces,
an unprivileged uid) whose pid 1 is the fork server. Each attempt is a fork of that server, so an
attempt costs milliseconds, not an interpreter start. The host side (this module) keeps every clock,
reads the attempt's typed results from a pipe and never trusts anything else the sandbox says.

`LocalSandboxPool` holds one warm sandbox per worker and lends them to threads.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import queue
import select
import selectors
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vrl import jail
from vrl_python_tests import harness

log = logging.getLogger(__name__)

SandboxMode = Literal["bwrap", "unsafe-local"]
SANDBOX_MODES = ("bwrap", "unsafe-local")
_HARNESS_SOURCE = Path(harness.__file__).read_text()
# Modules most attempts import, loaded once in the server so that each fork starts with them.
PRELOAD = ("math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string", "typing",
           "operator", "fractions", "decimal", "statistics", "datetime", "copy", "random", "json", "base64")
_SYSTEM_DIRS = jail.SYSTEM_DIRS
_UID_INSIDE = 1000
_START_TIMEOUT_S = 30.0
_CONTROL_TIMEOUT_S = 10.0
_OPT_OUT = ("only for code you trust, `-o sandbox=unsafe-local` (Python: sandbox='unsafe-local') runs attempts as "
            "plain processes of this user: they can then read every file this user can (the hidden tests "
            "included), reach the network and outlive their attempt")


class LocalSandboxUnavailable(ValueError):
    """The sandbox cannot run on this machine; the message says what is missing and what to do.

    A ValueError, like other setup problems, so `vrl train` reports it as an error line, not a traceback.
    """


#: How the sandbox server learns that an attempt exited: a pidfd (Linux 5.3+), falling back by itself to a pipe
#: that SIGCHLD writes to where pidfd_open answers ENOSYS (gVisor's release 20240729, tests/test_gvisor_real.py).
#: False takes the fallback everywhere: the tests check it on Linux too.
SERVER_PIDFD = True


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation settings shared by every sandbox of a pool."""

    mode: SandboxMode = "bwrap"
    memory_mb: int = 512  # address-space cap of each process of an attempt
    max_processes: int = 16  # processes (and threads) an attempt may run at once
    max_output_bytes: int = 4096  # stdout/stderr kept per attempt; the rest is discarded
    max_result_bytes: int = 1 << 20  # one test's encoded return value; more is a failed test
    max_file_mb: int = 16  # largest file an attempt may write; also the size of its tmpfs
    python: str | None = None  # interpreter inside the sandbox; None picks one the sandbox can run

    def __post_init__(self) -> None:
        if self.mode not in SANDBOX_MODES:
            raise ValueError(f"sandbox must be one of {', '.join(SANDBOX_MODES)}, got {self.mode!r}")
        for name in ("memory_mb", "max_processes", "max_output_bytes", "max_result_bytes", "max_file_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb={self.memory_mb} is too small to start Python; use at least 64")


CallKind = Literal["value", "error", "timeout", "crashed"]
ImportStatus = Literal["ok", "error", "syntax", "timeout", "crashed"]


@dataclass(frozen=True)
class CallResult:
    """What one call of the entry point (one test) gave back, not yet judged: the verifier compares it."""

    kind: CallKind  # value: it returned; error: it raised; timeout: out of time; crashed: it did not finish
    elapsed_s: float = 0.0
    value: Any = None  # kind 'value': the return value as encoded on the result channel (`harness.encode`)
    message: str = ""  # kind 'error': the exception; kind 'crashed': what happened


@dataclass
class RunResult:
    """What came back from one attempt: the import outcome and one raw outcome per test."""

    import_status: ImportStatus  # 'ok': the code loaded and `tests` holds one result per test input
    import_error: str = ""
    tests: list[CallResult] = field(default_factory=list)
    output: str = ""
    elapsed_s: float = 0.0
    attempt_timed_out: bool = False


# -- picking and checking the environment --------------------------------------------------------------

def _world_usable(path: str) -> bool:
    """True when an unrelated uid can reach `path` (every parent searchable, the file readable)."""
    p = Path(path)
    try:
        for parent in reversed(p.parents):
            if not parent.stat().st_mode & stat.S_IXOTH:
                return False
        mode = p.stat().st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IROTH) and (bool(mode & stat.S_IXOTH) or p.is_dir())


def _drops_uid() -> bool:
    # Root on the host: the sandbox gets its own unprivileged uid, so RLIMIT_NPROC applies (root is
    # exempt from it) and nothing in the sandbox maps to root on the host.
    return os.geteuid() == 0


def pick_python(preferred: str | None, mode: SandboxMode) -> str:
    """The interpreter to run inside the sandbox (absolute, symlinks resolved)."""
    if preferred:
        path = shutil.which(preferred) or preferred
        real = os.path.realpath(path)
        if not os.access(real, os.X_OK):
            raise LocalSandboxUnavailable(f"python={preferred!r} is not an executable interpreter")
        if mode == "bwrap" and _drops_uid() and not _world_usable(real):
            raise LocalSandboxUnavailable(
                f"python={real} is not readable by an unprivileged user (a parent directory lacks o+x); "
                "pick an interpreter under /usr or another world-readable prefix")
        return real
    candidates = [os.path.join(sys.base_prefix, "bin", "python3"), sys.executable, "/usr/bin/python3",
                  "/usr/local/bin/python3"]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if not os.access(real, os.X_OK):
            continue
        if mode == "bwrap" and _drops_uid() and not _world_usable(real):
            continue
        return real
    raise LocalSandboxUnavailable(
        "no Python interpreter that an unprivileged sandbox user can run was found (tried "
        f"{', '.join(candidates)}); install python3 under /usr or pass python=/path/to/python3")


def _prefix_of(python: str) -> str:
    """The installation prefix to bind (the directory above bin/)."""
    return str(Path(python).parent.parent)


@functools.cache
def check_bwrap(python: str) -> None:
    """Fail with a clear message unless bubblewrap can start `python` in a full sandbox here: vrl's
    jail first (`vrl.jail.probe`: namespaces, the seccomp filter; under gVisor it learns to keep the
    container's network namespace), then this sandbox's own interpreter in it."""
    try:
        jail.probe()
    except jail.Unavailable as exc:
        raise LocalSandboxUnavailable(f"{exc}; or, {_OPT_OUT}") from None
    if _inside(python, ["/tmp", "/dev", "/proc"]):
        raise LocalSandboxUnavailable(
            f"python={python} lies under a directory the sandbox replaces with its own (/tmp, /dev, /proc); "
            "use an interpreter installed elsewhere")
    fd = jail.seccomp_fd()
    argv = bwrap_argv(python, tmpfs_mb=1, seccomp_fd=fd) + [python, "-I", "-S", "-c", "pass"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_START_TIMEOUT_S, cwd="/",
                              check=False, pass_fds=(fd,), **spawn_user(0))
    except subprocess.TimeoutExpired:
        raise LocalSandboxUnavailable("bubblewrap did not start a sandbox within 30 s") from None
    finally:
        os.close(fd)
    if proc.returncode != 0:
        raise LocalSandboxUnavailable(
            f"bubblewrap cannot create its sandbox here: {proc.stderr.strip()[-300:] or f'exit code {proc.returncode}'} "
            f"(starting {python} as an unprivileged user in it); or, {_OPT_OUT}")


def spawn_user(slot: int) -> dict[str, Any]:
    """Popen arguments that run bwrap under the sandbox's own host uid (only when we are root)."""
    if not _drops_uid():
        return {}
    # One host uid per (process, slot): sandboxes never share a uid with each other or with a user.
    uid = 1_500_000_000 + (os.getpid() % 1_000_000) * 64 + slot % 64
    return {"user": uid, "group": uid, "extra_groups": []}


def bwrap_argv(python: str, tmpfs_mb: int, seccomp_fd: int | None = None) -> list[str]:
    """The bubblewrap command line (without the command to run).

    The namespaces and the seccomp filter are vrl's jail (`vrl.jail`: no socket, no new user
    namespace, the same under gVisor). The root and `/dev` are read-only; `/tmp` and `/dev/shm` are
    the only writable places, each a tmpfs of `tmpfs_mb` MiB that the server wipes after every
    attempt. Of the host, only what the interpreter needs is visible (see `visible_paths`), with every
    Python package directory masked. `seccomp_fd` (`vrl.jail.seccomp_fd`) is read by bwrap.
    """
    argv = [jail.bwrap(), *jail.namespace_args(), "--as-pid-1", "--clearenv",
            "--uid", str(_UID_INSIDE), "--gid", str(_UID_INSIDE), "--hostname", "sandbox"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
    binds, links, masks = visible_paths(python)
    for path in binds:
        argv += ["--ro-bind", path, path]
    for target, path in links:
        argv += ["--symlink", target, path]
    for path in masks:
        # An empty read-only tmpfs over the directory: its files (other packages, this plugin's task
        # data with hidden tests and reference solutions) do not exist inside.
        argv += ["--size", "4096", "--perms", "0555", "--tmpfs", path, "--remount-ro", path]
    size = str(tmpfs_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size,
             "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


_USR_PARTS = jail.USR_PARTS  # what an interpreter and its extension modules need of /usr (vrl.jail's list)


def visible_paths(python: str) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """What of the host the sandbox sees: (paths bound read-only, (target, path) symlinks, masked dirs).

    Bound: the parts of /usr above, the system dirs that are not symlinks into /usr, and for an
    interpreter outside /usr its binary, its `lib`/`lib64` and `pyvenv.cfg` (not its whole prefix).
    Masked (an empty read-only tmpfs on top): every `site-packages`/`dist-packages` directory of a
    bound Python installation, and this plugin's own package directory wherever it is installed, so
    neither other packages nor the bundled hidden tests are inside.
    """
    candidates = [p for p in _USR_PARTS if os.path.isdir(p)]
    candidates += [p for p in _SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)]
    prefix = _prefix_of(python)
    if not _inside(python, candidates):
        candidates.append(os.path.realpath(python))
        candidates += [os.path.join(prefix, d) for d in ("lib", "lib64") if os.path.isdir(os.path.join(prefix, d))]
        if os.path.isfile(os.path.join(prefix, "pyvenv.cfg")):
            candidates.append(os.path.join(prefix, "pyvenv.cfg"))
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for path in candidates:
        # A symlink (a venv's lib64 -> lib) stays one: bound twice, a directory would need two masks.
        if os.path.islink(path) and _inside(path, [b for b in candidates if not os.path.islink(b)]):
            links.append((os.readlink(path), path))
            continue
        real = os.path.realpath(path)
        binds.append(real)  # bound where it really is, so masks (real paths too) land on it
        if real != path:
            links.append((real, path))
    masks: set[str] = set()
    for root in binds:
        if not os.path.isdir(root):
            continue
        for pattern in ("python*/site-packages", "python*/dist-packages", "*/python*/site-packages",
                        "*/python*/dist-packages"):
            masks.update(os.path.realpath(p) for p in glob.glob(os.path.join(root, pattern)) if os.path.isdir(p))
    package = os.path.realpath(os.path.dirname(__file__))
    masks.add(package)
    # Only what the sandbox can see, and only the outermost (inside a masked one, a path does not exist).
    masks = {m for m in masks if _inside(m, binds)}
    outer = [m for m in sorted(masks) if not _inside(m, [o for o in masks if o != m])]
    return binds, links, outer


def _inside(path: str, roots: list[str]) -> bool:
    """True when `path` is one of `roots` or below one, compared without symlinks."""
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip("/") + "/"):
            return True
    return False


# -- one sandbox -----------------------------------------------------------------------------------

class _Dead(Exception):
    """The sandbox stopped answering; it will be restarted."""


@dataclass(frozen=True)
class _Unreadable:
    """A result line the host could not take: longer than allowed (`oversize`) or not a JSON object."""

    oversize: bool = False
    why: str = ""


class Sandbox:
    """One warm sandbox: a bubblewrap container whose pid 1 forks a child per attempt."""

    def __init__(self, config: SandboxConfig, slot: int = 0):
        self.config = config
        self.slot = slot
        self.python = pick_python(config.python, config.mode)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._workdir: tempfile.TemporaryDirectory | None = None

    # -- lifecycle --
    def start(self) -> None:
        """Start (or restart) the container and wait for the server's hello."""
        self.close()
        cfg = self.config
        results_r, results_w = os.pipe()
        output_r, output_w = os.pipe()
        payload_r, payload_w = os.pipe()
        passed = [results_w, output_w, payload_r]  # the sandbox's ends, closed here once it started
        limits = {
            "RLIMIT_AS": cfg.memory_mb << 20,
            "RLIMIT_FSIZE": cfg.max_file_mb << 20,
            "RLIMIT_NOFILE": 64,
            "RLIMIT_CORE": 0,
        }
        if cfg.mode == "bwrap":
            check_bwrap(self.python)
            # Counted per uid inside the sandbox's user namespace, where the server is the only other.
            limits["RLIMIT_NPROC"] = cfg.max_processes + 1
            scratch, workdir = ["/tmp", "/dev/shm"], "/tmp"  # the only writable places (the root is read-only)
            passed.append(jail.seccomp_fd())
            argv = bwrap_argv(self.python, cfg.max_file_mb, seccomp_fd=passed[-1])
            env = None
        else:
            self._workdir = tempfile.TemporaryDirectory(prefix="vrl-unsafe-")
            scratch, workdir = [self._workdir.name], self._workdir.name
            argv = []
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        server_config = {"limits": limits, "scratch": scratch, "workdir": workdir, "preload": list(PRELOAD),
                         "fds": {"results": results_w, "output": output_w, "payload": payload_r},
                         "pidfd": SERVER_PIDFD}
        argv = argv + [self.python, "-I", "-S", "-B", "-c", _HARNESS_SOURCE, json.dumps(server_config)]
        stderr = tempfile.TemporaryFile()
        # bwrap's --die-with-parent follows the *thread* that starts it: a sandbox started from a thread
        # that later exits dies with it, and the next attempt restarts it. Pool threads live until close().
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd="/",
                close_fds=True, pass_fds=tuple(passed),
                **(spawn_user(self.slot) if cfg.mode == "bwrap" else {}),
            )
        finally:
            for fd in passed:
                os.close(fd)
        self._stderr = stderr
        self._results, self._output, self._payload = results_r, output_r, payload_w
        for fd in (results_r, output_r, payload_w):
            os.set_blocking(fd, False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._bufs = {results_r: b"", output_r: b"", self.proc.stdout.fileno(): b""}
        self._selector = selectors.DefaultSelector()
        for fd in self._bufs:
            self._selector.register(fd, selectors.EVENT_READ)
        self._kept_output = b""
        try:
            hello = self._control(time.monotonic() + _START_TIMEOUT_S)
        except _Dead:
            stderr.seek(0)
            why = stderr.read().decode(errors="replace").strip()[-2000:]
            self.close()
            raise LocalSandboxUnavailable(f"the sandbox server did not start: {why or 'no output'}") from None
        if hello.get("op") != "hello":
            self.close()
            raise LocalSandboxUnavailable(f"the sandbox server said {hello!r} instead of hello")
        if cfg.mode == "bwrap" and not hello.get("init"):
            self.close()
            raise LocalSandboxUnavailable("the sandbox server is not pid 1 of its pid namespace; bwrap ignored --as-pid-1")
        self.starts += 1

    def close(self) -> None:
        """Kill the container (everything in it dies with its pid 1) and release the pipes."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait()
        self._selector.close()
        for fd in (self._results, self._output, self._payload):
            try:
                os.close(fd)
            except OSError:
                pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._stderr.close()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- the pipes --
    def _pump(self, deadline: float) -> bool:
        """Read whatever is ready until `deadline`; False when the deadline passed with nothing read."""
        timeout = deadline - time.monotonic()
        if timeout < 0:
            return False
        events = self._selector.select(timeout)
        if not events:
            return False
        control = self.proc.stdout.fileno()
        for key, _ in events:
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                if fd == control:
                    raise _Dead("sandbox server closed its channel")
                continue
            if fd == self._output:
                room = self.config.max_output_bytes - len(self._kept_output)
                if room > 0:
                    self._kept_output += chunk[:room]
                continue  # the rest is read and dropped so the attempt never blocks on a full pipe
            self._bufs[fd] += chunk
        return True

    def _line(self, fd: int, deadline: float, limit: int) -> bytes | None:
        """The next line from `fd`; None at the deadline or (for results) when a control line arrived."""
        control = self.proc.stdout.fileno()
        while True:
            buf = self._bufs[fd]
            cut = buf.find(b"\n")
            if cut >= 0:
                self._bufs[fd] = buf[cut + 1:]
                return buf[:cut]
            if len(buf) > limit:
                raise _Oversize()
            if fd != control and b"\n" in self._bufs[control]:
                return None
            if not self._pump(deadline) and time.monotonic() >= deadline:
                return None

    def _control(self, deadline: float) -> dict[str, Any]:
        line = self._line(self.proc.stdout.fileno(), deadline, 1 << 16)
        if line is None:
            raise _Dead("sandbox server did not answer in time")
        return json.loads(line)

    def _command(self, obj: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            raise _Dead("sandbox server closed its channel") from None

    def _cleanup(self) -> bool:
        """Kill the attempt's processes and wipe scratch; False if the sandbox needs a restart."""
        self._command({"op": "kill"})
        deadline = time.monotonic() + _CONTROL_TIMEOUT_S
        while True:
            reply = self._control(deadline)
            if reply.get("op") == "cleaned":
                break
        clean = bool(reply.get("clean"))
        # Nothing in the sandbox can write to the result pipe now: drop stale bytes.
        while self._pump(time.monotonic()):
            pass
        self._bufs[self._results] = b""
        return clean

    def _write_payload(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._payload, view):]
            except BlockingIOError:
                _, writable, _ = select.select([], [self._payload], [], max(0.0, deadline - time.monotonic()))
                if not writable:
                    raise _Dead("the attempt's process stopped reading its payload") from None

    # -- one attempt --
    def run(self, code: str, entry_point: str, inputs: list[dict[str, Any]], test_timeout_s: float,
            attempt_timeout_s: float) -> RunResult:
        """Run `code` and call `entry_point` on each input; raw outcomes come back, never judged here."""
        if not inputs:
            raise ValueError("an attempt needs at least one test input")
        if not self.alive:
            self.start()
        start = time.monotonic()
        attempt_deadline = start + attempt_timeout_s
        payload = json.dumps({"code": code, "entry_point": entry_point, "tests": inputs}).encode()
        self._kept_output = b""
        result = RunResult(import_status="ok")
        try:
            while True:
                outcome = self._run_child(payload, len(result.tests), len(inputs), test_timeout_s,
                                          attempt_deadline, result)
                if not self._cleanup():
                    log.debug("sandbox %d kept scratch it could not wipe; restarting it", self.slot)
                    self.start()
                if outcome == "done" or result.import_status != "ok" or len(result.tests) >= len(inputs):
                    break
                if time.monotonic() >= attempt_deadline:
                    result.attempt_timed_out = True
                    break
        except (_Dead, ValueError, OSError) as exc:
            log.debug("sandbox %d failed during an attempt (%s); restarting it", self.slot, exc)
            self.close()
            if result.import_status == "ok" and not result.tests:
                result.import_status = "crashed"
                result.import_error = f"the sandbox stopped: {exc}"
        for _ in range(len(result.tests), len(inputs)):
            result.tests.append(CallResult("timeout") if result.attempt_timed_out else CallResult("crashed", message="not run"))
        result.output = self._kept_output.decode(errors="replace")
        result.elapsed_s = time.monotonic() - start
        return result

    def _wait(self, deadline: float, exited: list[str]) -> dict[str, Any] | _Unreadable | None:
        """The child's next message (a JSON object: see `harness`), or the line it sent that is not one;
        None at the deadline or once it exited with nothing more to say."""
        limit = self.config.max_result_bytes + 1024
        control = self.proc.stdout.fileno()
        while True:
            try:
                line = self._line(self._results, deadline, limit)
            except _Oversize:
                return _Unreadable(oversize=True)
            if line is not None:
                try:
                    msg = json.loads(line, parse_constant=_reject_constant, parse_int=harness.parse_int)
                except (ValueError, RecursionError) as exc:
                    return _Unreadable(why=f"{type(exc).__name__}: {str(exc)[:200]}")
                return msg if isinstance(msg, dict) else _Unreadable(why="not a JSON object")
            while b"\n" in self._bufs[control]:
                text, self._bufs[control] = self._bufs[control].split(b"\n", 1)
                reply = json.loads(text)
                if reply.get("op") == "exited":
                    exited.append(str(reply.get("status")))
                elif reply.get("op") == "cleaned":  # only after our kill; never while waiting
                    raise _Dead("sandbox server cleaned up unasked")
            if exited:
                # It exited: whatever it wrote before is in the pipe already.
                while self._pump(time.monotonic()):
                    pass
                if b"\n" not in self._bufs[self._results]:
                    return None
            elif time.monotonic() >= deadline:
                return None

    def _run_child(self, payload: bytes, first: int, count: int, test_timeout_s: float, attempt_deadline: float,
                   result: RunResult) -> str:
        """One child from test `first` on. Returns 'done', 'timeout' (a test timed out) or 'crashed'."""
        self._command({"op": "spawn", "start": first})
        exited: list[str] = []
        ready = self._wait(time.monotonic() + _CONTROL_TIMEOUT_S, exited)
        if not isinstance(ready, dict) or not ready.get("ready"):
            why = f"the attempt's process {exited[0] if exited else 'did not start'}"
            if first == 0:
                result.import_status, result.import_error = "crashed", why
            else:
                result.tests.append(CallResult("crashed", message=why))
            return "crashed"
        self._write_payload(len(payload).to_bytes(8, "big") + payload, time.monotonic() + _CONTROL_TIMEOUT_S)
        t0 = time.monotonic()
        msg = self._wait(min(attempt_deadline, t0 + test_timeout_s), exited)
        if not isinstance(msg, dict) or msg.get("import") != "ok":
            if msg is None and not exited:
                # It may still be reading the payload; a restart guarantees no stale bytes are left.
                raise_after = True
            else:
                raise_after = False
            if first == 0:
                if msg is None and exited:
                    result.import_status = "crashed"
                    result.import_error = f"the attempt's process {exited[0]} while loading"
                elif msg is None:
                    result.import_status = "timeout"
                    result.import_error = f"loading the code took longer than {time.monotonic() - t0:.3g} s"
                    result.attempt_timed_out = time.monotonic() >= attempt_deadline
                elif isinstance(msg, _Unreadable):
                    result.import_status, result.import_error = "crashed", "the attempt garbled its result channel"
                else:
                    status = msg.get("import")
                    result.import_status = status if status in ("error", "syntax") else "crashed"
                    result.import_error = str(msg.get("error", "the attempt garbled its result channel"))[:500]
            else:
                # The code loaded before; now it does not: count the test it was about to run as crashed.
                result.tests.append(CallResult("crashed", message="reloading the code for the remaining tests failed"))
            if raise_after:
                raise _Dead("the attempt's process hung while loading")
            return "crashed"
        for index in range(first, count):
            t0 = time.monotonic()
            msg = self._wait(min(attempt_deadline, t0 + test_timeout_s), exited)
            elapsed = time.monotonic() - t0
            if msg is None:
                if exited:
                    result.tests.append(CallResult("crashed", elapsed, message=f"the attempt's process {exited[0]}"))
                    return "crashed"
                result.tests.append(CallResult("timeout", elapsed))
                if time.monotonic() >= attempt_deadline:
                    result.attempt_timed_out = True
                return "timeout"
            if isinstance(msg, _Unreadable):
                if msg.oversize:
                    why = f"return value larger than {self.config.max_result_bytes} bytes"
                    result.tests.append(CallResult("error", elapsed, message=why))
                else:
                    result.tests.append(CallResult("crashed", elapsed, message=f"unreadable result line ({msg.why})"))
                return "crashed"
            if msg.get("i") != index or not ("value" in msg or "error" in msg):
                result.tests.append(CallResult("crashed", elapsed, message="the attempt wrote out of turn on its result channel"))
                return "crashed"
            if "error" in msg:
                result.tests.append(CallResult("error", elapsed, message=str(msg["error"])[:500]))
            else:
                result.tests.append(CallResult("value", elapsed, value=msg["value"]))
        return "done"


class _Oversize(Exception):
    """A message longer than allowed on the result channel."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid on the result channel")


# -- a pool of sandboxes ---------------------------------------------------------------------------

def default_workers() -> int:
    """One sandbox per usable core: verification is CPU-bound and must not oversubscribe."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class LocalSandboxPool:
    """A fixed set of warm sandboxes on this machine lent to threads, one attempt at a time each.

    (Not `vrl.runtime.modal.SandboxPool`, the Modal runtime's pool of remote verifier sandboxes.)
    """

    def __init__(self, config: SandboxConfig, workers: int | None = None):
        self.config = config
        self.workers = workers or default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        self._idle: queue.Queue[Sandbox] = queue.Queue()
        self._all: list[Sandbox] = []
        self._lock = threading.Lock()
        self._closed = False

    def preflight(self) -> None:
        """Raise LocalSandboxUnavailable now, with what is missing, rather than at the first attempt."""
        python = pick_python(self.config.python, self.config.mode)
        if self.config.mode == "bwrap":
            check_bwrap(python)

    def _ensure(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox pool is closed")
            if self._all:
                return
            for slot in range(self.workers):
                box = Sandbox(self.config, slot)
                self._all.append(box)
                self._idle.put(box)

    def run(self, code: str, entry_point: str, inputs: list[dict[str, Any]], test_timeout_s: float,
            attempt_timeout_s: float) -> RunResult:
        """Run one attempt in the next free sandbox (blocks until one is free)."""
        self._ensure()
        box = self._idle.get()
        try:
            return box.run(code, entry_point, inputs, test_timeout_s, attempt_timeout_s)
        finally:
            self._idle.put(box)

    @property
    def starts(self) -> int:
        """How many times a sandbox container was started (restarts included)."""
        return sum(b.starts for b in self._all)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            boxes, self._all = self._all, []
        for box in boxes:
            box.close()
