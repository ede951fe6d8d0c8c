"""Child processes that must not outlive this one, however it ends: vLLM's engine processes.

vLLM starts its engine (`VLLM::EngineCore`, and the engine's own workers) in processes of its own,
which keep running when their parent dies without running its shutdown path: SIGKILL, the OOM killer,
or a SIGTERM with no handler, such as torchrun ending the other ranks of a failed launch or a job
scheduler's stop (vLLM issue 55510, open for the version vrl carries). The orphan keeps its GPU
memory, so the next run on that GPU fails for lack of it, and it keeps the parent's stderr open, so a
caller waiting for that pipe's end waits too. Both were seen on 2 × H200: torchrun ended rank 0 of a
7B launch, and its engine held 35 GB of GPU 0 until the machine was given back.

`reaped_children()` wraps the start of such processes. The children of this process that appear
inside the block are registered with one watchdog process per vrl process (`python -m vrl.reaper`),
which holds the read end of a pipe whose write end only this process holds. When this process ends,
however it ends, the kernel closes that pipe; the watchdog then sends SIGTERM to every registered
process and to each one's descendants, and SIGKILL to those still alive `GRACE_S` seconds later.
A process that ends on its own (an engine shut down) is `release`d. Each process is known by its pid
*and* its start time, so a pid the kernel has since given to another process is never signalled.

Linux only (it reads /proc); elsewhere `reaped_children()` registers nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

GRACE_S = 10.0
"""Seconds between the watchdog's SIGTERM (vLLM's engine shuts down cleanly on it) and its SIGKILL."""

Identity = tuple[int, int]
"""A process: its pid and its start time (clock ticks after boot, /proc/<pid>/stat field 22)."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of `pid`, or None if it is gone (or is a zombie: it has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, start time)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                out[int(name)] = stat
    return out


def children(pid: int | None = None) -> set[Identity]:
    """The live children of `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {(child, start) for child, (parent, start) in _processes().items() if parent == pid}


def identities(pids: list[int]) -> set[Identity]:
    """Those of `pids` that are running, each with its start time (for `reaped_children`'s set: a process
    another one started for us, such as a fork server's child)."""
    return {(pid, stat[1]) for pid in pids if (stat := _stat(pid)) is not None}


def alive(identity: Identity) -> bool:
    """Whether that process is still running (the same process: same pid and start time)."""
    stat = _stat(identity[0])
    return stat is not None and stat[1] == identity[1]


def tree(roots: set[Identity]) -> set[Identity]:
    """The live processes among `roots` and all their descendants."""
    table = _processes()
    found = {r for r in roots if r[0] in table and table[r[0]][1] == r[1]}
    frontier = {pid for pid, _ in found}
    while frontier:
        nxt = {pid for pid, (parent, _) in table.items() if parent in frontier} - {pid for pid, _ in found}
        found |= {(pid, table[pid][1]) for pid in nxt}
        frontier = nxt
    return found


def _signal(targets: set[Identity], sig: int) -> None:
    for identity in targets:
        if alive(identity):  # checked just before: a pid given to another process is left alone
            with contextlib.suppress(OSError):
                os.kill(identity[0], sig)


def reap(roots: set[Identity], grace_s: float = GRACE_S) -> None:
    """SIGTERM to `roots` and their descendants; SIGKILL to those alive after `grace_s` (and to
    descendants that appeared meanwhile)."""
    targets = tree(roots)
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(t) for t in targets):
        time.sleep(0.1)
    _signal(targets | tree(roots), signal.SIGKILL)


class Reaper:
    """This process's watchdog (one per process; `reaper()` starts it on first use)."""

    def __init__(self, grace_s: float):
        # A session of its own: a Ctrl-C to the terminal's process group, or a launcher's signal to it,
        # must not end the watchdog before it has done its work. It ends when its work is done.
        # No stdout or stderr of ours: a caller waiting for our stderr's end must not wait for the watchdog.
        self.proc = subprocess.Popen([sys.executable, "-m", "vrl.reaper", str(grace_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True)
        self.lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self.lock:
            try:
                self.proc.stdin.write(f"{line}\n".encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):  # the watchdog is gone: nothing left to tell it
                pass

    def register(self, identities: set[Identity]) -> None:
        for pid, start in sorted(identities):
            self._send(f"+ {pid} {start}")

    def release(self, identities: set[Identity]) -> None:
        for pid, start in sorted(identities):
            self._send(f"- {pid} {start}")


_reaper: Reaper | None = None
_reaper_lock = threading.Lock()
_inherited: list[Reaper] = []  # a forked child's copy of its parent's watchdog, kept so nothing closes its fd twice


def reaper() -> Reaper:
    global _reaper
    with _reaper_lock:
        if _reaper is None or _reaper.proc.poll() is not None:
            _reaper = Reaper(GRACE_S)
        return _reaper


def _forget_in_child() -> None:
    """A forked child must not hold the write end of its parent's pipe (the watchdog would wait for the
    child too) and must not talk to the parent's watchdog: close it and start afresh if asked."""
    global _reaper, _reaper_lock
    _reaper_lock = threading.Lock()  # another thread may have held it at the fork
    if _reaper is not None:
        with contextlib.suppress(OSError, ValueError):
            os.close(_reaper.proc.stdin.fileno())  # the raw fd: the file object's own lock may be held
        _inherited.append(_reaper)
        _reaper = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def reaped_children() -> Iterator[set[Identity]]:
    """Register the children this process starts inside the block (also when the block raises), and the
    processes the block adds to the set it yields (`identities`). After the block the set holds them all,
    for `release`."""
    out: set[Identity] = set()
    if not os.path.isdir("/proc/self"):
        yield out
        return
    before = children()
    try:
        yield out
    finally:
        out |= children() - before
        if out:
            reaper().register(out)


def release(identities: set[Identity]) -> None:
    """Those processes have ended (or been ended) on purpose: the watchdog forgets them."""
    if identities and _reaper is not None:
        _reaper.release(identities)


def _watch(grace_s: float) -> None:
    """The watchdog's life: track registrations from stdin until it closes, then reap what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    registered: set[Identity] = set()
    for line in sys.stdin.buffer:
        try:
            op, pid, start = line.decode().split()
            identity = (int(pid), int(start))
        except ValueError:
            continue
        if op == "+":
            registered.add(identity)
        else:
            registered.discard(identity)
    if registered:
        reap(registered, grace_s)


if __name__ == "__main__":
    _watch(float(sys.argv[1]) if len(sys.argv) > 1 else GRACE_S)
