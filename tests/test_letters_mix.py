"""`letters -o mix=true`: a prover-like mix of always-, never- and sometimes-solved tasks under a binary
reward (issue 58's CPU benchmark, benchmarks/curriculum_letters.py); the default letters is unchanged."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
from rich.console import Console

import vrl
from vrl.envs.letters import SOMETIMES_SHARE, LettersVerifier
from vrl.plugins import registry
from vrl.reward import Binary, PartialCredit
from vrl.trainer import Trainer
from vrl.types import Attempt, Completion, Task


def _verdict(task: Task, text: str):
    return LettersVerifier().check(Attempt(task=task, completion=Completion(task_id=task.id, text=text)))


def test_the_mix_gives_each_fourth_task_a_kind_and_a_binary_reward():
    env = registry().environment("letters", mix=True, size=10)
    kinds = [t.data["kind"] for t in env.tasks()]
    assert kinds == ["sometimes", "always", "never", "never"] * 2 + ["sometimes", "always"]
    assert isinstance(env.shaper(), Binary)
    plain = registry().environment("letters")
    assert all(t.data == {} for t in plain.tasks()) and isinstance(plain.shaper(), PartialCredit)


def test_always_and_never_do_not_depend_on_the_text_and_sometimes_passes_at_an_eighth_of_a_p():
    always, never, sometimes = (Task(id=k, prompt="p", data={"kind": k}) for k in ("always", "never", "sometimes"))
    for text in ("", "zzzz", "abcd"):
        assert _verdict(always, text).passed and not _verdict(never, text).passed
        assert _verdict(always, text).metrics == {} == _verdict(never, text).metrics
    assert SOMETIMES_SHARE == 0.125
    passing, failing = _verdict(sometimes, "ab" + "z" * 14), _verdict(sometimes, "a" + "z" * 15)
    assert passing.passed and passing.score == 1.0 and not failing.passed and failing.score == 0.0
    assert passing.metrics == {"letters/sometimes_attempts": 1.0, "letters/sometimes_passed": 1.0}
    assert failing.metrics == {"letters/sometimes_attempts": 1.0, "letters/sometimes_passed": 0.0}
    assert not _verdict(sometimes, "").passed
    # without the option a task has no kind: the old rule (pass = every character in a-p, partial score)
    plain = Task(id="t", prompt="p")
    assert not _verdict(plain, "ab" + "z" * 14).passed and _verdict(plain, "ab" + "z" * 14).score == 0.125
    with pytest.raises(ValueError, match="unknown task kind 'often'"):
        _verdict(Task(id="x", prompt="p", data={"kind": "often"}), "a")


def test_the_iteration_reports_the_sometimes_pass_rate():
    env = registry().environment("letters", mix=True)
    assert env.iteration_metrics({"letters/sometimes_attempts": 8.0, "letters/sometimes_passed": 2.0}) == {
        "letters/sometimes_attempts": 8.0, "letters/sometimes_passed": 2.0, "letters/sometimes_pass_rate": 0.25}
    assert env.iteration_metrics({}) == {}


def test_in_the_loop_the_curriculum_retires_the_always_and_never_solved_tasks(tmp_path):
    """GRPO on the tiny model, 1 iteration over all 4 tasks (one of each kind, two never): with one
    observation enough, the always-solved task is retired as too easy and the two never-solved ones as too
    hard, whatever the model wrote; the sometimes-solved one stays unless its 8 samples agreed."""
    cfg = vrl.TrainConfig(plugin="letters", optimizer="grpo", iterations=1, tasks_per_iteration=4,
                          env_options={"mix": True, "size": 4}, curriculum={"kind": "pass_rate", "min_observations": 1},
                          logging={"runs_dir": str(tmp_path), "name": "mix"})
    trainer = Trainer(cfg, console=Console(file=io.StringIO()))
    assert trainer.run()["status"] == "finished"
    (row,) = trainer.run_dir.metrics()
    assert row["curriculum/retired_high"] >= 1 and row["curriculum/retired_low"] >= 2
    assert row["letters/sometimes_attempts"] == 8
    assert row["letters/sometimes_pass_rate"] == row["letters/sometimes_passed"] / 8


def _benchmark():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "curriculum_letters.py"
    spec = importlib.util.spec_from_file_location("curriculum_letters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_pools_the_latest_iterations_until_the_window_holds_enough_attempts():
    reached = _benchmark().reached
    rows = [{"iteration": i, "tokens": 100.0, "loop_s": 0.5, "letters/sometimes_attempts": a,
             "letters/sometimes_passed": p} for i, (a, p) in enumerate([(16, 0), (16, 16), (8, 8), (16, 16)])]
    # iteration 1 alone holds 16 < 32 attempts: pooled with iteration 0, 16/32 = 0.5 reaches the target
    assert reached(rows, 32, 0.5) == {"iteration": 1, "updates": 2, "tokens": 200.0, "wall_s": 1.0,
                                      "pass_rate": 0.5, "attempts_pooled": 32}
    # 0.7: iteration 2 pools 2, 1 and 0 (24 of 40, 0.6); iteration 3 pools 3, 2 and 1 (40 of 40)
    assert reached(rows, 32, 0.7)["iteration"] == 3 and reached(rows, 32, 0.7)["attempts_pooled"] == 40
    assert reached(rows, 200, 0.1) is None  # never enough attempts
    assert reached([{**r, "letters/sometimes_passed": 0} for r in rows], 32, 0.5) is None


def test_the_benchmark_compares_each_seed_with_its_own_baseline(capsys):
    def entry(seed, tokens):
        return {"seed": seed, "reached": tokens and {"tokens": tokens, "updates": tokens / 100, "wall_s": 1.0},
                "load_before": 1.0, "load_after": 2.0}

    result = {"runs": {"grpo/baseline": [entry(0, 1000.0), entry(1, 4000.0)],
                       "grpo/curriculum": [entry(0, 500.0), entry(1, 4000.0)],
                       "grpo/filter": [entry(0, None), entry(1, 2000.0)]}}
    _benchmark().summarize(result)
    summary = result["summary"]
    assert summary["grpo/curriculum"]["tokens_vs_baseline"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert summary["grpo/curriculum"]["tokens"] == {"median": 2250.0, "min": 500.0, "max": 4000.0}
    assert summary["grpo/filter"]["reached"] == "1/2" and summary["grpo/filter"]["tokens_vs_baseline"]["median"] == 0.5
    assert result["load_range"] == [1.0, 2.0]
