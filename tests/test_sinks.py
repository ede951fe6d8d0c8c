"""MLflow and W&B sinks, run for real against local stores (no server, no network)."""

import json
import time

import pytest

from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.sinks import Sink, Sinks
from vrl.trainer import Trainer


def config(tmp_path, **logging):
    return build({
        "iterations": 2, "tasks_per_iteration": 2, "sampling": {"max_new_tokens": 4}, "es": {"population_size": 2},
        "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", **logging},
    })


def test_mlflow_receives_the_same_metric_names(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store; real setups use a tracking server
    Trainer(config(tmp_path, mlflow=True, mlflow_experiment="vrl-test"), environment=LettersEnvironment()).run()
    run_id = json.loads((tmp_path / "runs" / "r" / "sinks.json").read_text())["mlflow"]
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["es.population_size"] == "2"
    history = client.get_metric_history(run_id, "reward_mean")
    local = [json.loads(line) for line in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(h.step, h.value) for h in history] == [(r["iteration"], r["reward_mean"]) for r in local]
    assert "status/failed" in run.data.metrics


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    Trainer(config(tmp_path, wandb=True, wandb_project="vrl-test"), environment=LettersEnvironment()).run()
    run_id = json.loads((tmp_path / "runs" / "r" / "sinks.json").read_text())["wandb"]
    records = list((tmp_path / "runs" / "r" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(records) == 1
    deadline = time.monotonic() + 30  # wandb's service process finishes writing the file on its own
    while b"reward_mean" not in (data := records[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    # the run's protobuf records: our metric names and config are in it
    for key in (b"reward_mean", b"pass_rate", b"status/failed", b"population_size"):
        assert key in data, key


def test_a_failing_sink_is_dropped_not_fatal(tmp_path, caplog):
    class Flaky(Sink):
        name = "flaky"

        def log(self, metrics, step):
            raise ConnectionError("tracking server down")

    sinks = Sinks([Flaky()])
    sinks.start(tmp_path, {})
    sinks.log({"reward_mean": 1.0, "reasons": {"x": 1}}, step=0)
    assert sinks.sinks == [] and "tracking server down" in caplog.text
    sinks.log({"reward_mean": 1.0}, step=1)  # nothing left to fail


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match=r"wandb is not installed: pip install 'vrl-core\[wandb\]'"):
        Trainer(config(tmp_path, wandb=True), environment=LettersEnvironment())
    assert not (tmp_path / "runs" / "r").exists()  # failed before creating anything
