"""MLflow and W&B sinks, run for real against local stores (no server, no network)."""

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from vrl.cli import main
from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.rundir import RunDir
from vrl.sinks import Sink, SinkError, Sinks
from vrl.trainer import Trainer

SMALL = ["--set", "tasks_per_iteration=2", "--set", "es.population_size=2", "--set", "sampling.max_new_tokens=4"]


def config(tmp_path, iterations=2, **logging):
    return build({
        "iterations": iterations, "tasks_per_iteration": 2, "sampling": {"max_new_tokens": 4},
        "es": {"population_size": 2}, "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", **logging},
    })


def no_mlflow_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(key)


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def local_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli(tmp_path, *args, env=None):
    """`vrl` in a subprocess with a scrubbed environment: PATH, a fresh HOME, a wide log, one torch thread."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"), "COLUMNS": "250", "OMP_NUM_THREADS": "1",
             **(env or {})}
    return subprocess.run([sys.executable, "-m", "vrl.cli", *args], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cli_mlflow_run(tmp_path_factory):
    """The real CLI, with no MLFLOW_* variable, training 2 iterations with MLflow on: (its directory, its result).
    One run for the module: creating an MLflow store (its schema migrations) costs a few CPU-seconds each time."""
    pytest.importorskip("mlflow")
    here = tmp_path_factory.mktemp("cli-mlflow")
    res = cli(here, "train", "--plugin", "letters", "-n", "2", "--name", "r", "--set", "logging.mlflow=true", *SMALL)
    return here, res


@pytest.mark.slow  # subprocesses / training runs: tens of seconds on a loaded 2-core machine
def test_mlflow_works_with_no_environment_variables(cli_mlflow_run):
    """The real CLI with no MLFLOW_* variable logs to <runs_dir>/.mlflow/mlflow.db; read back with MLflow's client."""
    tmp_path, res = cli_mlflow_run
    assert res.returncode == 0, res.stderr
    assert "Unsupported" not in res.stderr and "metric sink" not in res.stderr
    run_dir = tmp_path / "runs" / "r"
    run_id = json.loads((run_dir / "sinks.json").read_text())["mlflow"]
    client = mlflow_client(f"sqlite:///{tmp_path / 'runs' / '.mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert client.get_experiment(run.info.experiment_id).name == "vrl"
    assert run.data.params["es.population_size"] == "2" and run.data.params["plugin"] == "letters"
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(h.step, h.value) for h in history] == [(r["iteration"], r["reward_mean"]) for r in local_rows(run_dir)]
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_mlflow_resume_continues_the_run_and_respects_the_tracking_uri(tmp_path, monkeypatch, cli_mlflow_run):
    """The user's MLFLOW_TRACKING_URI names an existing store elsewhere (the one the CLI run above made, in
    another directory; an experiment of this test's own): the run and its resume log there, not to runs/.mlflow."""
    no_mlflow_env(monkeypatch)
    uri = f"sqlite:///{cli_mlflow_run[0] / 'runs' / '.mlflow' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the user's choice wins over the default store
    Trainer(config(tmp_path, mlflow=True, mlflow_experiment="vrl-test"), environment=LettersEnvironment()).run()
    run_dir = tmp_path / "runs" / "r"
    Trainer(config(tmp_path, iterations=3, mlflow=True, mlflow_experiment="vrl-test"), run_dir=RunDir.open(run_dir),
            environment=LettersEnvironment()).run()
    assert not (tmp_path / "runs" / ".mlflow").exists()
    run_id = json.loads((run_dir / "sinks.json").read_text())["mlflow"]
    client = mlflow_client(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and client.get_experiment(run.info.experiment_id).name == "vrl-test"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume continued the same MLflow run
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(h.step, h.value) for h in history] == [(r["iteration"], r["reward_mean"]) for r in local_rows(run_dir)]
    assert [h.step for h in history] == [0, 1, 2]
    assert "status/failed" in run.data.metrics


@pytest.mark.slow  # training runs: seconds on a loaded 2-core machine
def test_a_sink_that_cannot_start_stops_the_run_before_iteration_0(tmp_path, monkeypatch):
    """An unusable tracking URI: one error line, exit 2, no run directory; best effort trains without it.
    In-process (click's runner): the refusal, its one line and the exit status are vrl's, the same in a process
    of its own (which paid ~6 CPU-seconds of torch and MLflow imports for them); that a real `vrl train` whose
    sink cannot start prints that one line and nothing else is tests/test_cli_day_one.py's W&B test."""
    pytest.importorskip("mlflow")
    no_mlflow_env(monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")  # read from the environment at start
    monkeypatch.chdir(tmp_path)
    args = ["train", "--plugin", "letters", "-n", "1", "--name", "r", "--set", "logging.mlflow=true", *SMALL]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "metric sink mlflow could not start" in lines[0], res.stderr
    assert "logging.sinks_best_effort=true" in lines[0]
    assert not (tmp_path / "runs" / "r").exists()
    res = CliRunner().invoke(main, [*args, "--set", "logging.sinks_best_effort=true"])
    assert res.exit_code == 0, res.output
    assert "metric sink mlflow failed" in res.stderr
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["status"] == "finished"
    assert not (tmp_path / "runs" / "r" / "sinks.json").exists() or "mlflow" not in (
        json.loads((tmp_path / "runs" / "r" / "sinks.json").read_text()))


def test_wandb_that_cannot_start_stops_the_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise wandb.errors.CommError("api key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(SinkError, match=r"metric sink wandb could not start \(CommError: api key not configured"):
        Trainer(config(tmp_path, wandb=True), environment=LettersEnvironment())
    assert not (tmp_path / "runs" / "r").exists()
    trainer = Trainer(config(tmp_path, wandb=True, sinks_best_effort=True), environment=LettersEnvironment())
    assert trainer.sinks.sinks == [] and trainer.run()["status"] == "finished"


def test_a_later_sink_failing_to_start_closes_the_runs_already_opened(tmp_path):
    events = []

    class Good(Sink):
        name = "good"

        def start(self, run_dir, config, ids):
            events.append("start")
            return "id-1"

        def finish(self, status):
            events.append(status)

    class Bad(Sink):
        name = "bad"

        def start(self, run_dir, config, ids):
            raise PermissionError("read-only store")

    with pytest.raises(SinkError, match=r"metric sink bad could not start \(PermissionError: read-only store\)"):
        Sinks([Good(), Bad()]).start(tmp_path, {})
    assert events == ["start", "failed"] and not (tmp_path / "sinks.json").exists()


@pytest.mark.slow
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
    with pytest.raises(SinkError, match=r"wandb is not installed: pip install 'vrl-core\[wandb\]'"):
        Trainer(config(tmp_path, wandb=True), environment=LettersEnvironment())
    assert not (tmp_path / "runs" / "r").exists()  # failed before creating anything
    trainer = Trainer(config(tmp_path, wandb=True, sinks_best_effort=True), environment=LettersEnvironment())
    assert trainer.sinks.sinks == []  # best effort: the run goes on without W&B
