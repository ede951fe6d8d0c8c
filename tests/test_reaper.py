"""`vrl.reaper`: processes started inside `reaped_children()` end when the process that started them dies.

Real processes and real signals throughout: a parent Python process starts a stand-in for vLLM's
engine the way vLLM 0.26 does (a `multiprocessing` spawn-context child, which starts a worker process
of its own), and the test SIGKILLs the parent, as the OOM killer or torchrun's escalation does. vLLM
itself cannot run here (no GPU); what the watchdog relies on is only that the engine is a child
process of the caller, started inside the block. The control case shows the orphan this guards
against: without the block, the engine outlives its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from vrl import reaper

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="vrl.reaper reads /proc (Linux)")

PARENT = textwrap.dedent("""
    import contextlib, multiprocessing as mp, os, signal, subprocess, sys, time
    import vrl.reaper as reaper

    def engine(ignore_term):
        if ignore_term:  # an engine stuck where it cannot act on SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) "
                          "if %r else None; time.sleep(600)" % ignore_term])
        time.sleep(600)

    if __name__ == "__main__":
        mode = sys.argv[1]
        reaper.GRACE_S = 1.0
        block = contextlib.nullcontext(set()) if mode == "plain" else reaper.reaped_children()
        with block as started:
            p = mp.get_context("spawn").Process(target=engine, args=(mode == "stubborn",), daemon=True)
            p.start()
        if mode == "released":
            reaper.release(started)
        if mode == "forked" and os.fork() == 0:  # a forked child holds copies of every descriptor
            time.sleep(600)
            os._exit(0)
        watchdog = reaper._reaper.proc.pid if reaper._reaper else 0
        print(p.pid, watchdog, flush=True)
        time.sleep(600)
""")


def wait_for(condition, timeout: float = 30.0) -> bool:
    """Poll `condition` until it holds or `timeout` s pass (a liveness bound, not a performance claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def identity(pid: int) -> reaper.Identity:
    stat = reaper._stat(pid)
    assert stat is not None, f"process {pid} is not running"
    return pid, stat[1]


def start_parent(tmp_path, mode: str):
    """The parent process, its engine and the engine's worker (both started), and the watchdog's pid."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    engine_pid, watchdog = map(int, parent.stdout.readline().split())
    engine = identity(engine_pid)
    assert wait_for(lambda: len(reaper.tree({engine})) == 2), "the engine's worker did not start"
    return parent, engine, watchdog


def kill_all(parent, engine, *others) -> None:
    for p in [*reaper.tree({engine}), *others]:
        if reaper.alive(p):
            os.kill(p[0], signal.SIGKILL)
    if parent.poll() is None:
        parent.kill()
    parent.wait()


@pytest.mark.parametrize("mode", ["reaped", "stubborn"])
def test_a_killed_parents_engine_and_its_worker_end(tmp_path, mode):
    """SIGKILL the parent: the watchdog ends the engine and the engine's worker ('stubborn': both ignore
    SIGTERM, so only the SIGKILL after the grace period ends them)."""
    parent, engine, watchdog = start_parent(tmp_path, mode)
    workers = reaper.tree({engine})
    try:
        assert watchdog and reaper.alive(identity(watchdog))
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not any(reaper.alive(p) for p in workers)), \
            f"still running after their parent died: {[p for p in workers if reaper.alive(p)]}"
        assert wait_for(lambda: reaper._stat(watchdog) is None), "the watchdog outlived its work"
    finally:
        kill_all(parent, engine, *workers)


def test_without_the_block_the_engine_outlives_its_parent(tmp_path):
    """The defect guarded against (vLLM issue 55510's mechanism): an engine started outside
    `reaped_children()` keeps running after its parent's SIGKILL."""
    parent, engine, _ = start_parent(tmp_path, "plain")
    try:
        parent.kill()
        parent.wait()
        time.sleep(3)
        assert reaper.alive(engine)
    finally:
        kill_all(parent, engine)


def test_a_released_engine_is_left_alone(tmp_path):
    """An engine released after its own shutdown is not the watchdog's: it does not signal it."""
    parent, engine, watchdog = start_parent(tmp_path, "released")
    try:
        parent.kill()
        parent.wait()
        assert wait_for(lambda: reaper._stat(watchdog) is None)
        assert reaper.alive(engine)
    finally:
        kill_all(parent, engine)


def test_a_forked_child_does_not_keep_the_watchdog_waiting(tmp_path):
    """A child forked after the engine started holds copies of the parent's descriptors; it closes its
    copy of the watchdog's pipe at the fork, so the parent's death still reaches the watchdog."""
    parent, engine, _ = start_parent(tmp_path, "forked")
    forked = [p for p in reaper.children(parent.pid) if p[0] != engine[0]]
    try:
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not reaper.alive(engine))
        assert forked and all(reaper.alive(p) for p in forked), "the forked child should still be running"
    finally:
        kill_all(parent, engine, *forked)


def test_a_pid_given_to_another_process_is_not_signalled():
    """A process is known by its pid and start time: a registration whose start time does not match
    (the pid reused by the kernel for another process) signals nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid, start = identity(proc.pid)
        reaper.reap({(pid, start + 1)}, grace_s=0.2)
        assert proc.poll() is None
        reaper.reap({(pid, start)}, grace_s=5)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
