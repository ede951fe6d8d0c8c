"""The run directory: everything a run leaves behind, written so that a crash loses nothing finished.

    runs/<name>/
      config.json     the resolved TrainConfig
      versions.json   python, torch, transformers, vrl and plugin versions
      metrics.jsonl   one line per finished iteration
      samples.jsonl   a bounded number of attempts per iteration (prompt, completion, verdict, reward)
      state.json      the last finished iteration (written last, atomically)
      summary.json    status (running, finished, interrupted, failed) and totals
      <optimizer files>  e.g. es_history.json
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from vrl.config import TrainConfig, dump
from vrl.meta import DISTRIBUTION


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename), so a crash never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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


class RunDir:
    """A run directory, created fresh or opened for resume."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, config: TrainConfig) -> RunDir:
        name = config.logging.name or f"{config.plugin}-{config.optimizer}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(config.logging.runs_dir) / name
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(
                f"run directory {path} already exists; continue it with `vrl train --resume {path}` "
                "or choose another --name"
            )
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        write_json(path / "config.json", dump(config))
        write_json(path / "versions.json", versions())
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a vrl run directory (no config.json)")
        return cls(path)

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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)

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
