"""Optional metric sinks: MLflow and Weights & Biases, with the metric names of metrics.jsonl.

Neither is a dependency: enabling one without its package installed is a clear error at start-up.
A sink that fails mid-run logs a warning and is dropped; it never stops training. Sink run ids are
kept in the run directory (`sinks.json`) so `--resume` continues the same MLflow/W&B run.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Sink:
    name = "sink"

    def start(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> str | None:
        """Open (or reopen, given a stored id) the run; return an id to store for resume."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


class MLflowSink(Sink):
    name = "mlflow"

    def __init__(self, experiment: str):
        try:
            import mlflow
        except ImportError as exc:
            raise RuntimeError("logging.mlflow is on but mlflow is not installed: pip install 'vrl-core[mlflow]'") from exc
        self.mlflow, self.experiment = mlflow, experiment

    def start(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> str | None:
        self.mlflow.set_experiment(self.experiment)
        run = self.mlflow.start_run(run_id=ids.get(self.name), run_name=None if ids.get(self.name) else run_dir.name)
        if not ids.get(self.name):
            params = {k: str(v)[:500] for k, v in flatten(config).items()}
            self.mlflow.log_params(params)
        return run.info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def finish(self, status: str) -> None:
        self.mlflow.end_run(status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, project: str):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("logging.wandb is on but wandb is not installed: pip install 'vrl-core[wandb]'") from exc
        self.wandb, self.project = wandb, project

    def start(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> str | None:
        run_id = ids.get(self.name) or uuid.uuid4().hex[:12]
        self.run = self.wandb.init(
            project=self.project, name=run_dir.name, id=run_id, resume="allow", config=config, dir=str(run_dir)
        )
        return run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class Sinks:
    """The enabled sinks of a run, failure-isolated."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    @classmethod
    def from_config(cls, logging_config: Any) -> Sinks:
        sinks: list[Sink] = []
        if logging_config.mlflow:
            sinks.append(MLflowSink(logging_config.mlflow_experiment))
        if logging_config.wandb:
            sinks.append(WandbSink(logging_config.wandb_project))
        return cls(sinks)

    def start(self, run_dir: Path, config: dict[str, Any]) -> None:
        path = run_dir / "sinks.json"
        ids = json.loads(path.read_text()) if path.exists() else {}
        for sink in list(self.sinks):
            try:
                ids[sink.name] = sink.start(run_dir, config, ids)
            except Exception as exc:
                self._drop(sink, exc)
        if self.sinks:
            path.write_text(json.dumps(ids))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = numeric(metrics)
        for sink in list(self.sinks):
            try:
                sink.log(values, step)
            except Exception as exc:
                self._drop(sink, exc)

    def finish(self, status: str) -> None:
        for sink in list(self.sinks):
            try:
                sink.finish(status)
            except Exception as exc:
                self._drop(sink, exc)

    def _drop(self, sink: Sink, exc: Exception) -> None:
        log.warning("metric sink %s failed (%s: %s); continuing without it", sink.name, type(exc).__name__, exc)
        self.sinks.remove(sink)
