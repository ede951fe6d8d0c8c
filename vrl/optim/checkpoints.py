"""Checkpoints off the critical path: when to write one, whether it fits, writing it in the background,
and how many to keep.

An optimizer snapshots its state to host memory (the only part the loop waits for), then hands the
writing to `BackgroundWriter`, one checkpoint in flight at a time. A checkpoint is written under a
temporary name and renamed when complete, so a crash leaves the previous one. Before writing, the
space it needs is compared with the free space of the disk (`free_bytes`, replaceable in tests): a
checkpoint that cannot fit is refused in one line, the last good one stays, and the run stops
(`CheckpointRefused`) or goes on, as configured.

Standard library only at import (the trainer imports `CheckpointRefused`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from vrl.errors import UsageError
from vrl.fileio import TMP_SUFFIX

log = logging.getLogger(__name__)


class CheckpointRefused(UsageError):
    """A checkpoint was not written because the disk cannot hold it; the last good one is kept."""


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class Cadence:
    """When a checkpoint is due: every `every` iterations (0: never by count), or once `interval_s`
    seconds have passed since the last one (0: never by time), and always after the run's last iteration."""

    def __init__(self, every: int, interval_s: float, total: int | None, clock: Callable[[], float] = time.monotonic):
        self.every, self.interval_s, self.total, self.clock = every, interval_s, total, clock
        self.last = clock()

    def due(self, iteration: int) -> bool:
        return iteration == self.total or self.regular(iteration)

    def regular(self, iteration: int) -> bool:
        """Due by count or by time (whether or not it is the last iteration)."""
        if self.every and iteration % self.every == 0:
            return True
        return bool(self.interval_s) and self.clock() - self.last >= self.interval_s

    def done(self) -> None:
        self.last = self.clock()


def complete(folder: Path, prefix: str = "iter-") -> list[Path]:
    """The complete checkpoints in `folder`, oldest first (a `.tmp` one is still being written)."""
    return sorted(p for p in Path(folder).glob(f"{prefix}*") if p.is_dir() and not p.name.endswith(TMP_SUFFIX))


def prune(folder: Path, keep: int, prefix: str = "iter-") -> None:
    """Delete all but the newest `keep` complete checkpoints (never the newest one)."""
    for old in complete(folder, prefix)[: -max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


def check_room(folder: Path, needed: int, keep: int, probe: Callable[[Path], int] = free_bytes,
               prefix: str = "iter-") -> str | None:
    """Make room for a checkpoint of `needed` bytes in `folder`; None when it fits, else the one-line reason.

    Checkpoints beyond the `keep - 1` newest go first (the new one makes `keep`), and a stale
    temporary left by a crash; the newest complete checkpoint is never deleted.
    """
    folder = Path(folder)
    if folder.is_dir():
        prune(folder, keep - 1 if keep > 1 else 1, prefix)
        for stale in folder.glob(f"{prefix}*{TMP_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
    free = probe(folder)
    if needed <= free:
        return None
    kept = complete(folder, prefix)
    last = f"the last good one, {kept[-1].name}, is kept" if kept else "there is no earlier checkpoint"
    return (f"checkpoint refused: it needs {human(needed)} and {folder} has {human(free)} free; {last}. "
            "Free disk space, or lower grpo.keep_checkpoints")


class BackgroundWriter:
    """One background thread that finishes checkpoints (file writes, rename, pruning), one at a time."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[float] | None = None
        self.last_write_s = 0.0  # seconds the last finished background write took

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` in the background after the previous one (call `wait` first to bound memory)."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vrl-checkpoint")

        def timed() -> float:
            start = time.perf_counter()
            job()
            return time.perf_counter() - start

        self._pending = self._pool.submit(timed)

    def wait(self) -> None:
        """Block until the checkpoint being written is complete; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.last_write_s = pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def finish(tmp: Path, final: Path, keep: int, prefix: str = "iter-") -> None:
    """Rename a fully written checkpoint into place, then keep the newest `keep`."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(final.parent, keep, prefix)
