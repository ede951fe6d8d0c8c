"""Run directories are safe to use: one writer at a time, names that cannot collide or escape, a
failed start that leaves nothing behind, and a run that stops when its verifier goes down instead of
learning from crashed verdicts."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import vrl.rundir as rundir
from vrl.config import build
from vrl.envs.letters import LettersEnvironment, LettersVerifier
from vrl.errors import RunDirError
from vrl.rundir import RunDir
from vrl.trainer import Trainer
from vrl.types import Attempt, Status, Verdict
from vrl.verifier import VerifierUnavailable


def config(tmp_path: Path, name: str | None = "run", iterations: int = 2, **over):
    return build({"plugin": "letters", "iterations": iterations, "tasks_per_iteration": 2,
                  "sampling": {"max_new_tokens": 4}, "es": {"population_size": 2},
                  "logging": {"runs_dir": str(tmp_path), "name": name}}, over)


# -- names ------------------------------------------------------------------------------------------


def test_default_names_do_not_collide_within_one_second(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20260101-120000")  # every run in the same second
    cfg = config(tmp_path, name=None)
    runs = [RunDir.create(cfg) for _ in range(20)]
    assert len({r.path for r in runs}) == 20 and all((r.path / "config.json").is_file() for r in runs)
    assert all(r.name.startswith("letters-es-20260101-120000-") for r in runs)
    for r in runs:
        r.release()
    suffixes = iter(["beef", "beef", "cafe"])  # the second draw collides with the first: it draws again
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: next(suffixes))
    first, second = RunDir.create(cfg), RunDir.create(cfg)
    assert (first.name[-4:], second.name[-4:]) == ("beef", "cafe")


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "/abs", ".hidden", "", "x" * 201])
def test_a_run_name_cannot_leave_runs_dir(tmp_path, name):
    with pytest.raises(RunDirError, match="single directory name"):
        rundir.check_name(name)
    if name:  # an empty name means "pick a default one"
        cfg = config(tmp_path / "runs", name="ok")
        # Past the config's own validation (model_copy does not validate): RunDir checks again.
        cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"name": name})})
        with pytest.raises(RunDirError, match="single directory name"):
            RunDir.create(cfg)
        assert not (tmp_path / "x").exists() and list((tmp_path / "runs").iterdir()) == []


# -- one writer -------------------------------------------------------------------------------------


def _hold_lock(path: str, ready) -> None:
    run = RunDir.open(path)  # kept: the lock lives as long as this object's open lock file
    run.acquire()
    ready.set()
    threading.Event().wait(600)  # until killed


def test_second_writer_refused_and_a_dead_writers_lock_taken_over(tmp_path):
    run = RunDir.create(config(tmp_path))
    with pytest.raises(RunDirError, match=f"being written by process {os.getpid()}"):
        RunDir.open(run.path).acquire()  # a second writer, even in the same process
    run.release()

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(run.path), ready))
    holder.start()
    try:
        assert ready.wait(120)
        with pytest.raises(RunDirError, match=f"being written by process {holder.pid}.*kill {holder.pid}"):
            RunDir.open(run.path).acquire()
        with pytest.raises(RunDirError, match=f"being written by process {holder.pid}"):
            RunDir.create(config(tmp_path))  # a new run of the same name names the writer too
    finally:
        holder.kill()
        holder.join(60)
    again = RunDir.open(run.path)
    again.acquire()  # the dead process's lock is stale: taken over
    assert (run.path / "lock").read_text().strip() == str(os.getpid())
    again.release()


def test_trainer_holds_the_lock_while_it_runs_and_gives_it_back(tmp_path):
    seen = []

    def try_second_writer(metrics):
        with pytest.raises(RunDirError, match="being written by process"):
            RunDir.open(tmp_path / "run").acquire()
        seen.append(metrics["iteration"])

    Trainer(config(tmp_path), environment=LettersEnvironment(), on_iteration=try_second_writer).run()
    assert seen == [0, 1]
    RunDir.open(tmp_path / "run").acquire()  # free after the run


# -- a failed start leaves nothing ------------------------------------------------------------------


class _FailingRuntime:
    """The engine cannot be started (out of memory, say): the run fails before its first iteration."""

    def __init__(self, inner):
        self.inner = inner

    def policy(self, cfg, moves=None):
        raise RuntimeError("no memory for the model")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_new_run_that_fails_before_its_first_iteration_is_removed(tmp_path):
    trainer = Trainer(config(tmp_path), environment=LettersEnvironment())
    trainer.runtime = _FailingRuntime(trainer.runtime)
    with pytest.raises(RuntimeError, match="no memory"):
        trainer.run()
    assert not (tmp_path / "run").exists()  # the name is free again
    assert Trainer(config(tmp_path, iterations=1), environment=LettersEnvironment()).run()["status"] == "finished"


def test_a_resume_that_fails_before_an_iteration_restores_the_runs_summary(tmp_path):
    Trainer(config(tmp_path, iterations=1), environment=LettersEnvironment()).run()
    before = (tmp_path / "run" / "summary.json").read_bytes()
    trainer = Trainer(config(tmp_path, iterations=3), run_dir=RunDir.open(tmp_path / "run"), environment=LettersEnvironment())
    trainer.runtime = _FailingRuntime(trainer.runtime)
    with pytest.raises(RuntimeError, match="no memory"):
        trainer.run()
    assert (tmp_path / "run" / "summary.json").read_bytes() == before
    assert json.loads(before)["status"] == "finished"


# -- the verifier goes down mid-run -----------------------------------------------------------------


@contextmanager
def letters_server() -> Iterator[ThreadingHTTPServer]:
    """A verification service over HTTP: GET /health, POST /check with the completion text."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"status": "ok"})

        def do_POST(self) -> None:
            text = self.rfile.read(int(self.headers["Content-Length"])).decode()
            verdict = LettersVerifier().check(Attempt.model_validate(json.loads(text)))
            self._reply(verdict.model_dump(mode="json"))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


class RemoteVerifier(LettersVerifier):
    """Asks the service for every verdict; a failed request is a `crashed` verdict, as in the Lean client."""

    def __init__(self, url: str):
        self.url = url

    def check(self, attempt: Attempt) -> Verdict:
        request = urllib.request.Request(self.url + "/check", data=attempt.model_dump_json().encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return Verdict.model_validate_json(resp.read())
        except OSError as exc:
            return Verdict.fail(Status.CRASHED, f"verification service unreachable: {exc}")

    async def check_ready(self) -> None:
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5).close()
        except OSError as exc:
            raise VerifierUnavailable(f"the verification service at {self.url} is down ({exc}); start it again") from None


class RemoteLetters(LettersEnvironment):
    def __init__(self, url: str):
        super().__init__()
        self.url = url

    def verifier(self) -> RemoteVerifier:
        return RemoteVerifier(self.url)


def test_training_stops_when_the_verifier_goes_down_keeping_finished_iterations(tmp_path):
    with letters_server() as httpd:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"

        def go_down_after_two(metrics):
            if metrics["iteration"] == 1:
                httpd.shutdown()
                httpd.server_close()  # connections are refused from now on

        trainer = Trainer(config(tmp_path, iterations=5), environment=RemoteLetters(url), on_iteration=go_down_after_two)
        with pytest.raises(VerifierUnavailable, match=r"(\d+) of \1 verdicts crashed and the verifier is down: .* is down"):
            trainer.run()
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "VerifierUnavailable" in summary["error"]
    assert summary["iterations_completed"] == 2
    assert [m["iteration"] for m in RunDir.open(run).metrics()] == [0, 1]
    history = json.loads((run / "es_history.json").read_text())
    assert len(history["iterations"]) == 2  # the crashed iteration was never told to the optimizer


def test_a_crashing_verifier_that_is_up_does_not_stop_training(tmp_path):
    """Crashed verdicts from a healthy verifier (a REPL that died on one proof) are ordinary verdicts,
    even all of them. (A `check` that raises is the verifier's own bug: that stops the run, test_trainer.py.)"""

    class AlwaysCrashes(LettersVerifier):
        def check(self, attempt):
            return Verdict.fail(Status.CRASHED, "the REPL died: segfault")

    class Env(LettersEnvironment):
        def verifier(self):
            return AlwaysCrashes()

    summary = Trainer(config(tmp_path, iterations=2), environment=Env()).run()
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    last = RunDir.open(tmp_path / "run").metrics()[-1]
    assert last["status/crashed"] == last["completions"] > 0
