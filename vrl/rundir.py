"""The run directory: everything a run leaves behind, written so that a crash loses nothing finished.

    runs/<name>/
      config.json     the resolved TrainConfig
      versions.json   python, torch, transformers, vrl and plugin versions
      model.json      a local --model's content digest (vrl.local_model): a resume or an export refuses a changed one
      metrics.jsonl   one line per finished iteration
      samples.jsonl   a bounded number of attempts per iteration (prompt, completion, verdict, reward)
      tasks.jsonl     with dynamic sampling or a curriculum: one row per drawn task (vrl.schedule)
      state.json      the last finished iteration (written last, atomically)
      summary.json    status (running, finished, interrupted, failed) and totals
      lock            the pid of the process writing the run (held with flock while it runs)
      <optimizer files>  e.g. es_history.json

One process writes a run directory at a time: `create` and `acquire` take an exclusive `flock` on
`lock` and keep it until `release` (or the process's end, so a crashed writer leaves no stale lock).
A run directory on a store that must hold no open file of its own keeps that lock in `lock_dir`
instead (a Modal Volume refuses to reload while a file is open; its run lease guards the run there).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import platform
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from vrl import distributed
from vrl.config import RUN_NAME_RE, RUN_NAME_RULE, dump
from vrl.errors import RunDirError
from vrl.fileio import write_text
from vrl.meta import DISTRIBUTION
from vrl.optim import optimizer_class, optimizer_names

if TYPE_CHECKING:
    from vrl.config import TrainConfig

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
MODEL_FILE = "model.json"
#: Config fields that define the weights or what the finished iterations mean: a resume keeps them,
#: with the run's optimizer's own (`Optimizer.fixed_on_resume`: ES replays its history with those
#: settings; a GRPO checkpoint holds LoRA weights of that shape).
FIXED_ON_RESUME = ("plugin", "model", "optimizer", "seed", "generator.revision", "generator.dtype")


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (see `write_text`)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file, ignoring a torn last line left by a crash."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def check_name(name: str) -> str:
    """A run name is one directory name under runs_dir: never a path, never `..`."""
    if not RUN_NAME_RE.fullmatch(name):
        raise RunDirError(f"bad run name {name!r}: {RUN_NAME_RULE}")
    return name


def default_name(config: TrainConfig) -> str:
    """<plugin>-<optimizer>-<date>-<time>-<4 hex>: the suffix keeps two runs started in one second apart."""
    plugin = re.sub(r"[^A-Za-z0-9._-]", "_", config.plugin)
    return f"{plugin}-{config.optimizer}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class RunDir:
    """A run directory, created fresh or opened for resume."""

    def __init__(self, path: Path, lock_dir: Path | None = None):
        self.path = Path(path)
        self.lock_dir = Path(lock_dir) if lock_dir is not None else None
        self._lock: IO[str] | None = None

    @property
    def lock_path(self) -> Path:
        """The file the writer's flock is held on: `lock` in the run directory, or `<name>.lock` in `lock_dir`."""
        return self.path / LOCK_FILE if self.lock_dir is None else self.lock_dir / f"{self.path.name}.lock"

    @classmethod
    def create(cls, config: TrainConfig, lock_dir: Path | None = None) -> RunDir:
        """Make a new run directory atomically and lock it; an existing one is never reused."""
        runs_dir = Path(config.logging.runs_dir)
        runs_dir.mkdir(parents=True, exist_ok=True)
        if config.logging.name:
            path = runs_dir / check_name(config.logging.name)
            try:
                try:
                    path.mkdir()
                except FileExistsError:
                    path.rmdir()  # an empty directory may be reused; rmdir refuses any other
                    path.mkdir()
            except OSError:
                probe = cls(path, lock_dir)
                if probe.lock_path.is_file():  # a live writer is named rather than "exists"
                    probe.acquire()
                    probe.release()
                raise RunDirError(
                    f"run directory {path} already exists; continue it with `vrl train --resume {path}` "
                    "or choose another --name"
                ) from None
        else:
            for _ in range(100):  # a 4-hex suffix: a second collision in one second is already rare
                path = runs_dir / default_name(config)
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    continue
            else:  # pragma: no cover - 100 collisions in a row
                raise RunDirError(f"could not find a free run name in {runs_dir}; pass --name")
        run = cls(path, lock_dir)
        run.acquire()
        write_json(path / "config.json", dump(config))
        write_json(path / "versions.json", versions())
        identity = model_identity(config.model)
        if identity is not None:
            write_json(path / MODEL_FILE, identity)
        return run

    @classmethod
    def open(cls, path: str | Path, lock_dir: Path | None = None) -> RunDir:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise RunDirError(f"{path} is not a vrl run directory (no config.json)")
        return cls(path, lock_dir)

    # -- one writer at a time ----------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        """Whether this object holds the run directory's lock."""
        return self._lock is not None

    def acquire(self) -> None:
        """Take the writer's lock, or refuse, naming the process that holds it.

        A lock left by a process that died is free (the kernel drops a flock with its holder), so it
        is simply taken over. A file system without flock support only gets a warning. The ranks > 0
        of a torchrun launch take no lock: rank 0 writes the run, they only read its checkpoints.
        """
        if self._lock is not None or distributed.is_follower():
            return
        if self.lock_dir is not None:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                handle.close()
                log.warning("cannot lock %s (%s); make sure no other process writes this run", self.path, exc)
                return
            handle.seek(0)
            pid = handle.read().strip()
            handle.close()
            holder = f"process {pid}" if pid.isdigit() else "another process"
            raise RunDirError(
                f"run directory {self.path} is being written by {holder}; wait for it to finish or stop it "
                f"(kill {pid or 'PID'}), then resume with `vrl train --resume {self.path}`"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        """Give up the writer's lock (the lock file stays; it holds no lock by itself)."""
        handle, self._lock = self._lock, None
        if handle is not None:
            handle.close()

    def remove(self) -> None:
        """Delete the run directory (a fresh run that failed before finishing any iteration)."""
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)

    # -- resume rules ------------------------------------------------------------------------------
    def check_resume(self, config: TrainConfig) -> None:
        """Refuse a resume that would change what the finished iterations mean (model, optimizer...)."""
        recorded, new = self.config(), dump(config)
        name = str(recorded.get("optimizer"))
        own = optimizer_class(name).fixed_on_resume if name in optimizer_names() else ()
        fields = FIXED_ON_RESUME + tuple(f"{name}.{f}" for f in own)
        for field in fields:
            before, after = _get(recorded, field, _MISSING), _get(new, field)
            if before is not _MISSING and before != after:  # a field older configs lack: the optimizer checks it
                raise RunDirError(
                    f"cannot resume {self.path} with {field}={after!r}: the run was trained with {field}={before!r}, "
                    "which a resume keeps; start a new run (--name) to change it"
                )
        self.check_model("resume")

    def check_model(self, doing: str) -> None:
        """Refuse to `doing` (resume, export) a run whose local --model's files changed since it started: both
        rebuild from the base weights. Nothing to compare for a Hub id (its revision is `generator.revision`), a
        run older than model.json, or a model absent here (a Modal run's folder on its Volume is checked by
        content there: `vrl.runtime.modal.models.place`)."""
        recorded_path = self.path / MODEL_FILE
        if not recorded_path.is_file():
            return
        recorded = json.loads(recorded_path.read_text())
        now = model_identity(recorded["model"])
        if now is None or now["sha256"] == recorded["sha256"]:
            return
        raise RunDirError(
            f"cannot {doing} {self.path}: model {recorded['model']} changed since the run started (its files' sha256 "
            f"was {recorded['sha256'][:16]}…, is {now['sha256'][:16]}… now), and the finished iterations were trained "
            "from the old weights; put the old files back, or start a new run (--name) from the new ones"
        )

    @property
    def name(self) -> str:
        return self.path.name

    def config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def completed_iterations(self) -> int:
        state = self.path / "state.json"
        return json.loads(state.read_text())["iteration"] if state.exists() else 0

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "metrics.jsonl")

    def truncate_metrics(self, iterations: int) -> None:
        """Drop metric lines past the last finished iteration (a crash between two writes)."""
        self._truncate("metrics.jsonl", iterations)

    def _truncate(self, filename: str, iterations: int) -> None:
        """Keep the rows of `filename` from iterations before `iterations` (written atomically)."""
        path = self.path / filename
        rows = [r for r in read_jsonl(path) if r["iteration"] < iterations]
        write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

    def rewind(self, iterations: int) -> None:
        """Forget every iteration from `iterations` on (the optimizer resumed from an older checkpoint)."""
        self._truncate("metrics.jsonl", iterations)
        self._truncate("samples.jsonl", iterations)
        write_json(self.path / "state.json", {"iteration": iterations})

    def append(self, filename: str, rows: list[dict[str, Any]]) -> None:
        with open(self.path / filename, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish_iteration(self, iteration: int) -> None:
        write_json(self.path / "state.json", {"iteration": iteration + 1})

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / "summary.json", summary)

    def summary(self) -> dict[str, Any] | None:
        """The last summary written, or None before the first."""
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


_MISSING = object()


def model_identity(model: str) -> dict[str, Any] | None:
    """{"model", "sha256"} of a local --model that exists here (`vrl.local_model.digest`), else None."""
    from vrl import local_model

    if not local_model.is_local(model) or not local_model.source(model).exists():
        return None
    return {"model": model, "sha256": local_model.digest(model, local_model.WEIGHT_FILES)}


def _get(data: dict[str, Any], dotted: str, missing: Any = None) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return missing
        data = data[part]
    return data


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    from vrl.plugins import registry

    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in (DISTRIBUTION, "torch", "transformers", "pydantic", "pluggy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    out["plugins"] = {p.name: p.version for p in registry().plugins.values() if not p.error}
    return out
