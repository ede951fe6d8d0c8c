"""Optional metric sinks: MLflow and Weights & Biases, with the metric names of metrics.jsonl.

Neither is a dependency. A sink that cannot start (package missing, tracking store unusable, W&B
refusing the run) stops the run before its first iteration with the reason, unless
`logging.sinks_best_effort` is on; then it is skipped with a warning. A sink that fails mid-run
logs a warning and is dropped; it never stops training. Sink run ids are kept in the run directory
(`sinks.json`) so `--resume` continues the same MLflow/W&B run.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MLFLOW_DB = ".mlflow/mlflow.db"  # hidden: `vrl report runs/*` must match run directories only


class SinkError(RuntimeError):
    """A metric sink could not start; the message says which and why."""


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

    def hint(self, exc: BaseException) -> str:
        """What to do about `exc`, an error from `start` (empty: nothing specific to say)."""
        return ""


def mlflow_tracking_uri(runs_dir: Path) -> str:
    """The user's MLFLOW_TRACKING_URI if set, else a SQLite store in the runs directory (.mlflow/mlflow.db).

    MLflow's own default (sqlite:///mlflow.db in the working directory) needs SQLAlchemy, and its
    file store (./mlruns) refuses to open without MLFLOW_ALLOW_FILE_STORE=true; `vrl-core[mlflow]` brings
    SQLAlchemy, so this default works with no environment variables and keeps every run of a runs
    directory in one store.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(runs_dir).resolve() / MLFLOW_DB}"


class MLflowSink(Sink):
    """MLflow through its client API with an explicit tracking URI: no global mlflow state is set."""

    name = "mlflow"
    _BATCH = 100  # MLflow's limit of params per log_batch call

    def __init__(self, experiment: str, runs_dir: Path = Path("runs")):
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise SinkError("logging.mlflow is on but mlflow is not installed: pip install 'vrl-core[mlflow]'") from exc
        self.experiment, self.uri = experiment, mlflow_tracking_uri(runs_dir)
        self.client_class = MlflowClient
        self.run_id: str | None = None

    def start(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> str | None:
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # The registry is never used; naming it keeps MLflow from resolving (and warning about) its own default.
        self.client = self.client_class(tracking_uri=self.uri, registry_uri=os.environ.get("MLFLOW_REGISTRY_URI") or self.uri)
        if ids.get(self.name):  # resume: the same MLflow run
            self.run_id = ids[self.name]
            self.client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, self.experiment, self.uri)
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self._BATCH])
        return self.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, project: str):
        try:
            import wandb
        except ImportError as exc:
            raise SinkError("logging.wandb is on but wandb is not installed: pip install 'vrl-core[wandb]'") from exc
        self.wandb, self.project = wandb, project

    def start(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> str | None:
        run_id = ids.get(self.name) or uuid.uuid4().hex[:12]
        self.run = self.wandb.init(
            project=self.project, name=run_dir.name, id=run_id, resume="allow", config=config, dir=str(run_dir)
        )
        return run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def hint(self, exc: BaseException) -> str:
        text = str(exc).lower()
        if "api key" in text or "api_key" in text or "login" in text:
            return ("set WANDB_API_KEY (or run `wandb login`), or set WANDB_MODE=offline to keep the W&B run in the "
                    "run directory without an account (`wandb sync` uploads it later)")
        return ""

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class Sinks:
    """The enabled sinks of a run: a start failure is fatal (unless best effort), a later one drops the sink."""

    def __init__(self, sinks: list[Sink], best_effort: bool = False):
        self.sinks, self.best_effort = sinks, best_effort

    @classmethod
    def from_config(cls, logging_config: Any) -> Sinks:
        """The sinks `logging_config` enables; a missing package is a `SinkError` (a warning with best effort)."""
        best_effort = bool(getattr(logging_config, "sinks_best_effort", False))
        makers = []
        if logging_config.mlflow:
            makers.append(lambda: MLflowSink(logging_config.mlflow_experiment, logging_config.runs_dir))
        if logging_config.wandb:
            makers.append(lambda: WandbSink(logging_config.wandb_project))
        sinks: list[Sink] = []
        for make in makers:
            try:
                sinks.append(make())
            except SinkError as exc:
                if not best_effort:
                    raise
                log.warning("%s; logging.sinks_best_effort is on, so the run goes on without it", exc)
        return cls(sinks, best_effort)

    def start(self, run_dir: Path, config: dict[str, Any]) -> None:
        """Start every sink; raise `SinkError` naming the first that cannot (unless best effort)."""
        path = run_dir / "sinks.json"
        ids = json.loads(path.read_text()) if path.exists() else {}
        started: list[Sink] = []
        for sink in list(self.sinks):
            try:
                ids[sink.name] = sink.start(run_dir, config, ids)
                started.append(sink)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                if not self.best_effort:
                    Sinks(started, best_effort=True).finish("failed")  # close the runs already opened
                    fix = sink.hint(exc) or "fix it"
                    raise SinkError(
                        f"metric sink {sink.name} could not start ({reason}); {fix}, turn logging.{sink.name} off, "
                        "or set logging.sinks_best_effort=true to train without it"
                    ) from exc
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
