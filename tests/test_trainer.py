"""The fixed loop: overlap of generation and verification, and a run directory that survives Ctrl-C."""

import asyncio
import json
import time

import pytest

from vrl.config import build
from vrl.envs.letters import LettersEnvironment, LettersVerifier
from vrl.errors import RunDirError
from vrl.rundir import RunDir
from vrl.trainer import Trainer


def small_config(tmp_path, **overrides):
    layer = {
        "iterations": 3,
        "tasks_per_iteration": 4,
        "sampling": {"max_new_tokens": 8, "batch_size": 4},
        "es": {"population_size": 2},
        "logging": {"runs_dir": str(tmp_path), "name": "run"},
    }
    return build(layer, overrides)


class SlowChars(LettersEnvironment):
    """The toy environment with a verifier that takes `delay` seconds per batch (like a Lean server)."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay

    def verifier(self):
        delay = self.delay

        class Slow(LettersVerifier):
            async def verify(self, attempts):
                await asyncio.sleep(delay)
                return [self.check(a) for a in attempts]

        return Slow()


def test_verification_overlaps_generation(tmp_path):
    cfg = small_config(
        tmp_path,
        iterations=1,
        tasks_per_iteration=8,
        sampling={"max_new_tokens": 48, "batch_size": 2},
        es={"population_size": 4},
        verifier={"batch_size": 2, "concurrency": 1},
    )
    delay = 0.15  # per batch of 2 attempts, like a remote checker; 16 batches -> 2.4 s of verification
    trainer = Trainer(cfg, environment=SlowChars(delay))
    trainer.run()
    m = trainer.run_dir.metrics()[0]
    gen, ver = m["generation_s"], m["verification_s"]
    assert ver >= 16 * delay * 0.95, m  # the verifier really was slow
    # Serially the loop would cost gen + ver; overlapped it costs about max(gen, ver) plus the
    # last batch's check. Require that at least half of the shorter phase was hidden.
    assert m["loop_s"] < gen + ver - 0.5 * min(gen, ver), m
    assert m["verify_wait_s"] < ver, m


def test_metrics_samples_and_summary(tmp_path):
    cfg = small_config(tmp_path, logging={"samples_per_iteration": 3})
    summary = Trainer(cfg, environment=LettersEnvironment()).run()
    run = RunDir.open(tmp_path / "run")
    rows = run.metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["completions"] == 4 * 2  # tasks x members
        assert 0 <= r["reward_mean"] <= r["reward_max"] <= 1
        assert r["tokens"] > 0 and r["generation_s"] > 0 and r["loop_s"] >= r["generation_s"]
        assert sum(r[f"status/{s}"] for s in ("passed", "failed", "timeout", "crashed", "rejected")) == 8
    samples = [json.loads(line) for line in (run.path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 9 and {"completion", "verdict", "reward", "prompt"} <= set(samples[0])
    assert summary["status"] == "finished" and summary["iterations_completed"] == 3
    assert json.loads((run.path / "summary.json").read_text())["reward_last"] == rows[-1]["reward_mean"]
    assert json.loads((run.path / "config.json").read_text())["es"]["population_size"] == 2
    assert "torch" in json.loads((run.path / "versions.json").read_text())


def test_task_schedule_is_deterministic_and_covers_the_pool(tmp_path):
    trainer = Trainer(small_config(tmp_path), environment=LettersEnvironment(size=6))
    pool = trainer._task_pool()
    first_epoch = [t.id for i in range(3) for t in trainer.tasks_for(pool, i)][:6]
    assert sorted(first_epoch) == sorted(t.id for t in pool)
    assert [t.id for t in trainer.tasks_for(pool, 4)] == [t.id for t in trainer.tasks_for(pool, 4)]


def test_ctrl_c_between_iterations_keeps_finished_work(tmp_path):
    def stop_after_two(metrics):
        if metrics["iteration"] == 1:
            raise KeyboardInterrupt

    summary = Trainer(small_config(tmp_path, iterations=5), environment=LettersEnvironment(), on_iteration=stop_after_two).run()
    run = RunDir.open(tmp_path / "run")
    assert summary["status"] == "interrupted"
    assert run.completed_iterations() == 2
    assert [r["iteration"] for r in run.metrics()] == [0, 1]
    assert json.loads((run.path / "summary.json").read_text())["status"] == "interrupted"
    assert json.loads((run.path / "es_history.json").read_text())


def test_ctrl_c_mid_iteration_loses_only_that_iteration(tmp_path):
    class InterruptingEnv(LettersEnvironment):
        calls = 0

        def shaper(self):
            base = super().shaper()

            def shape(task, completion, verdict):
                InterruptingEnv.calls += 1
                if InterruptingEnv.calls > 8 + 3:  # inside the second iteration
                    raise KeyboardInterrupt
                return base(task, completion, verdict)

            return shape

    summary = Trainer(small_config(tmp_path), environment=InterruptingEnv()).run()
    run = RunDir.open(tmp_path / "run")
    assert summary["status"] == "interrupted"
    assert run.completed_iterations() == 1 and len(run.metrics()) == 1
    for name in ("config.json", "summary.json", "state.json", "versions.json"):
        json.loads((run.path / name).read_text())  # every file is whole


def test_exception_marks_run_failed_and_propagates(tmp_path):
    def explode(metrics):
        if metrics["iteration"] == 1:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        Trainer(small_config(tmp_path), environment=LettersEnvironment(), on_iteration=explode).run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "disk full" in summary["error"]
    assert summary["iterations_completed"] == 2


def test_crashing_verifier_scores_crashed_without_losing_the_iteration(tmp_path):
    class Broken(LettersEnvironment):
        def verifier(self):
            class Boom(LettersVerifier):
                async def verify(self, attempts):
                    raise ConnectionError("server went away")

            return Boom()

    Trainer(small_config(tmp_path, iterations=1), environment=Broken()).run()
    m = RunDir.open(tmp_path / "run").metrics()[0]
    assert m["status/crashed"] == 8 and m["reward_mean"] == 0.0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert "ConnectionError: server went away" in sample["verdict"]["detail"]


def test_hanging_verifier_becomes_timeouts(tmp_path):
    class Hangs(LettersEnvironment):
        def verifier(self):
            class Hang(LettersVerifier):
                async def verify(self, attempts):
                    await asyncio.sleep(3600)

            return Hang()

    start = time.perf_counter()
    Trainer(small_config(tmp_path, iterations=1, verifier={"timeout_s": 0.2}), environment=Hangs()).run()
    assert time.perf_counter() - start < 60
    assert RunDir.open(tmp_path / "run").metrics()[0]["status/timeout"] == 8


def test_existing_run_directory_is_not_overwritten(tmp_path):
    Trainer(small_config(tmp_path, iterations=1), environment=LettersEnvironment()).run()
    with pytest.raises(RunDirError, match="--resume"):
        Trainer(small_config(tmp_path, iterations=1), environment=LettersEnvironment())


def test_checkpoint_time_is_reported_apart_from_the_loop(tmp_path, monkeypatch):
    """`save_s` is the time spent writing the optimizer's state (a GRPO checkpoint of a 1.5B model
    takes tens of seconds), measured outside `loop_s`."""
    from vrl.optim.es import ES

    original = ES.save

    def slow_save(self, run_dir, final=False):
        time.sleep(1.0)
        original(self, run_dir, final)

    monkeypatch.setattr(ES, "save", slow_save)
    Trainer(small_config(tmp_path, iterations=2), environment=LettersEnvironment()).run()
    rows = RunDir.open(tmp_path / "run").metrics()
    assert all(r["save_s"] >= 1.0 for r in rows)
    assert all(r["loop_s"] < r["save_s"] for r in rows)  # the tiny loop is faster than the slow save
