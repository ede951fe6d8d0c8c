"""Fork servers (zygotes) for the emulator's function containers: torch and transformers imported once.

A fresh container is `python -m modal._container` in a new bubblewrap container of its image; one that
generates spends 4-6 CPU-seconds importing torch, transformers and the tiny model's code before it
takes an input, and the tests start dozens. Modal itself starts each container from its image in a
fresh interpreter (memory snapshots aside, which vrl does not request), so this is the emulator's
shortcut, made so that a container cannot tell:

- A zygote serves one *kind* of container: one image, one function (module and qualified name), the
  same environment (secrets and the function's `env` included; the container's and the service's ids
  aside) and the same Volume mount points. It runs in a bubblewrap container of that image built as a
  container's is (images.Layout.bwrap), so it sees the image's packages and files only, and imports
  with the environment the container has.
- It imports what a fresh container of that kind had imported, nothing more: every container reports
  the modules it has loaded (`container_next`), the first one of a kind always starts fresh, and the
  zygote imports those names in the same order (modal/_zygote.py). The zygote is launched (in the
  background) once a container of its kind has run an input, or at the kind's second start; from then on its
  containers fork from it, each with its own mount and PID namespace, its service socket, gVisor
  folder and Volume views bound in, its own session, stdio, environment and working directory.
- The service gets a `Forked` handle (pid, poll, wait, kill, returncode), as it gets a Popen from a
  fresh start, so its lifecycle code (timeouts, preemption, `vrl.reaper`'s tree kill) is the same.

Zygotes are shared by every emulator of this process (they hold no service state: a fork gets its
service's parts) and die with it (bwrap's --die-with-parent, from a thread that lives as long). At
most `MAX_ZYGOTES` at once; the least recently used goes first.

`VRL_MODAL_EMULATOR_FRESH=1` switches them off: every container is a fresh interpreter (a test about a
fresh container sets it). `VRL_MODAL_EMULATOR_STATS=<file>` appends, at exit, how many container
starts each way this process made.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

FRESH = "VRL_MODAL_EMULATOR_FRESH"
STATS = "VRL_MODAL_EMULATOR_STATS"
MAX_ZYGOTES = 3
HOST = "/opt/emu/host"  # this machine's root in a zygote (for the binds; hidden in its containers)
PER_CONTAINER = ("MODAL_TASK_ID", "VRL_MODAL_EMULATOR_KEY", "VRL_MODAL_EMULATOR_CONTAINER")
#: modules a zygote never imports ahead: the container's program itself runs as __main__
NOT_PRELOADED = ("__main__", "__mp_main__", "modal._container", "modal._zygote")

starts = {"fresh": 0, "forked": 0}
_lock = threading.Lock()
_profiles: dict[tuple, dict[str, None]] = {}  # kind -> modules a container of that kind loaded, in order
_seen: dict[tuple, int] = {}  # kind -> container starts so far
_zygotes: dict[tuple, Zygote] = {}
_starters: dict[tuple, Any] = {}  # kind -> how to start its zygote
_broken: set[tuple] = set()  # kinds whose forks failed: fresh containers only
_spawns: queue.Queue = queue.Queue()
_spawner: threading.Thread | None = None
_dir: Path | None = None
_ids = itertools.count(1)


def enabled() -> bool:
    return os.environ.get(FRESH, "") in ("", "0")


def kind(image_key: str, fn: dict, env: dict[str, str], mounts: list[str]) -> tuple:
    """What makes two containers interchangeable for a zygote."""
    shared = tuple(sorted((k, v) for k, v in env.items() if k not in PER_CONTAINER))
    return (image_key, fn["module"], fn["qualname"], shared, tuple(sorted(mounts)))


def learn(key: tuple, modules: list[str], worked: bool) -> None:
    """A container of `key` reports modules it loaded (in its import order); `worked`: it has run an
    input, so it imported what its inputs need: the kind's zygote starts now (in the background)."""
    with _lock:
        profile = _profiles.setdefault(key, {})
        for name in modules:
            if name not in NOT_PRELOADED:
                profile[name] = None
        if worked and profile and key in _starters and key not in _zygotes and key not in _broken:
            _launch(key, list(profile), _starters[key])


def fork(key: tuple, start_zygote, spec: dict, fds: list[int]) -> Forked | None:
    """A container forked from the zygote of `key`, or None (start it fresh). The second start of a kind
    whose modules are known launches its zygote (`start_zygote(folder) -> (argv, kwargs)`)."""
    with _lock:
        _seen[key] = _seen.get(key, 0) + 1
        _starters[key] = start_zygote
        zygote = _zygotes.get(key)
        if key in _broken:
            return None
        if zygote is not None and zygote.dead:
            del _zygotes[key]
            zygote = None
        if zygote is None:
            if _seen[key] >= 2 and _profiles.get(key):
                _launch(key, list(_profiles[key]), start_zygote)
            return None
        if not zygote.ready:
            return None
        zygote.used = next(_ids)
    return zygote.fork(spec, fds)


def failed(key: tuple, log: Path) -> None:
    """A container forked from the zygote of `key` ended before it asked for its function: that kind
    starts fresh from now on (each such failure would otherwise be retried as a crash, and again)."""
    with _lock:
        _broken.add(key)
        zygote = _zygotes.pop(key, None)
    if zygote is not None:
        zygote.close()
        if zygote.log.exists():
            with open(log, "ab") as out:  # the zygote's account of it (modal/_zygote.py prints it there)
                out.write(b"[emulator] forked from a zygote that failed; its log:\n" + zygote.log.read_bytes()[-4000:])


def _directory() -> Path:
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="modal-emu-zygotes-"))
        atexit.register(shutil.rmtree, _dir, True)
    return _dir


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen from one thread that lives as long as this process: a zygote's bwrap has --die-with-parent,
    which acts when the *thread* that started it ends."""
    global _spawner
    if _spawner is None:
        def run() -> None:
            while True:
                job = _spawns.get()
                try:
                    job[2].append(subprocess.Popen(job[0], **job[1]))
                except BaseException as exc:  # noqa: BLE001 - raised in the asking thread
                    job[2].append(exc)
                job[3].set()

        _spawner = threading.Thread(target=run, daemon=True, name="modal-emu-zygotes")
        _spawner.start()
    box: list = []
    done = threading.Event()
    _spawns.put((argv, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _launch(key: tuple, names: list[str], start_zygote) -> None:
    """Start the zygote of `key` (under `_lock`); it serves once it has imported `names`."""
    while len(_zygotes) >= MAX_ZYGOTES:
        oldest = min(_zygotes, key=lambda k: _zygotes[k].used)
        _zygotes.pop(oldest).close()
    base = _directory()
    n = next(_ids)
    preload = base / f"preload-{n}.txt"
    preload.write_text("\n".join(names))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    argv, kwargs = start_zygote(base / f"z{n}")
    log = open(base / f"zygote-{n}.log", "wb")  # noqa: SIM115 - the child holds it
    try:
        proc = _spawn(argv + ["-m", "modal._zygote", str(theirs.fileno()), HOST + str(preload)],
                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                      pass_fds=(theirs.fileno(),), **kwargs)
    finally:
        log.close()
        theirs.close()
    _zygotes[key] = Zygote(key, proc, ours, next(_ids), base / f"zygote-{n}.log")


class Zygote:
    """The service's side of one zygote: fork requests, the exit statuses of its containers."""

    def __init__(self, key: tuple, proc: subprocess.Popen, sock: socket.socket, used: int, log: Path):
        self.key, self.proc, self.sock, self.used, self.log = key, proc, sock, used, log
        self.ready = self.dead = self.served = self.closing = False
        self.host_pid: int | None = None
        self.info: dict = {}
        self.children: dict[int, Forked] = {}  # pid in the zygote's namespace -> handle
        self.early: dict[int, int] = {}  # statuses of children whose handle is not made yet
        self.replies: dict[int, queue.Queue] = {}
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="modal-emu-zygote").start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.sock.recv(1 << 16)
                if not msg:
                    break
                what, *rest = pickle.loads(msg)
                if what == "ready":
                    ns_pid, self.info = rest
                    self.host_pid = _host_pid(self.proc.pid, ns_pid)
                    self.ready = self.served = self.info["problem"] is None and self.host_pid is not None
                    if not self.ready:
                        break
                elif what == "forked":
                    self.replies.pop(rest[0]).put(rest[1])
                elif what == "exit":
                    ns_pid, status = rest
                    with _lock:
                        handle = self.children.pop(ns_pid, None)
                        if handle is None:
                            self.early[ns_pid] = status
                    if handle is not None:
                        handle._ended(os.waitstatus_to_exitcode(status))
        except OSError:
            pass
        if not self.served and not self.closing:  # refused, or died importing: its kind starts fresh from now on
            with _lock:
                _broken.add(self.key)
        self.dead, self.ready = True, False
        for reply in list(self.replies.values()):
            reply.put(None)
        with _lock:
            orphans, self.children = list(self.children.values()), {}
        for handle in orphans:  # PR_SET_PDEATHSIG: they die with the zygote
            handle._ended(-signal.SIGKILL)
        self.close()

    def fork(self, spec: dict, fds: list[int]) -> Forked | None:
        reply: queue.Queue = queue.Queue()
        rid = next(_ids)
        self.replies[rid] = reply
        try:
            with self.send_lock:
                socket.send_fds(self.sock, [pickle.dumps({**spec, "id": rid})], fds)
        except OSError:
            self.replies.pop(rid, None)
            return None
        try:
            ns_pid = reply.get(timeout=30)
        except queue.Empty:
            return None
        if ns_pid is None:
            return None
        handle = Forked(_child_host_pid(self.host_pid, ns_pid))
        with _lock:
            if ns_pid in self.early:
                handle._ended(os.waitstatus_to_exitcode(self.early.pop(ns_pid)))
            else:
                self.children[ns_pid] = handle
        return handle

    def close(self) -> None:
        self.closing = self.dead = True
        self.ready = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)


class Forked:
    """A container forked from a zygote, as the service handles a Popen: its outer process (bwrap's, whose
    child is the container's PID 1). The zygote reports its exit status."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int | None):
        self.pid = pid if pid is not None else -1
        self.returncode: int | None = None
        self._done = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("forked container", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _ns_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(p) for p in line.split()[1:]]
    except OSError:
        pass
    return []


def _kids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _host_pid(root: int, ns_pid: int) -> int | None:
    """This machine's pid of the zygote: the descendant of its bwrap whose innermost pid is `ns_pid`."""
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid != root and _ns_pids(pid)[-1:] == [ns_pid] and len(_ns_pids(pid)) > 1:
            return pid
        todo += _kids(pid)
    return None


def _child_host_pid(zygote: int | None, ns_pid: int) -> int | None:
    for pid in _kids(zygote) if zygote else ():
        if _ns_pids(pid)[-1:] == [ns_pid]:
            return pid
    return None


def _close_all() -> None:
    with _lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
    path = os.environ.get(STATS)
    if path and sum(starts.values()):
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **starts}) + "\n")


atexit.register(_close_all)
