"""The built-in multi-turn game `guess`: its verifier replays the episode's guesses (trusting nothing the
environment reported), and with its suggested settings the tiny model learns to use the feedback."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from vrl.config import resolve_config
from vrl.envs.guess import GuessEnvironment, GuessVerifier, feedback, read_guess
from vrl.types import Attempt, Completion, Episode, Status, Task, Turn


def _judge(secret: int, *turns: str):
    episode = Episode(turns=[Turn(role="assistant", content=t, passed=True) for t in turns])  # passed: ignored
    c = Completion(task_id="t", text=turns[-1], episode=episode)
    return GuessVerifier().check(Attempt(task=Task(id="t", prompt="", data={"secret": secret}), completion=c))


def test_the_verifier_replays_the_guesses() -> None:
    assert _judge(7, "3", "8", "7").passed and "turn 3" in _judge(7, "3", "8", "7").detail
    v = _judge(7, "3", "9x", "5")  # no right guess: the closest one (9, two away) counts
    assert not v.passed and v.score == pytest.approx(1 - 2 / 9)
    v = _judge(0, "a", "b")
    assert v.status is Status.FAILED and v.score == 0.0
    assert (read_guess("  4 is it"), read_guess("x4")) == (4, None)
    assert (feedback(3, 7), feedback(9, 7), feedback(7, 7), feedback(None, 7)) == (
        "higher", "lower", "correct", "Answer with one digit.")
    tasks = GuessEnvironment(size=5).tasks("train")
    assert tasks == GuessEnvironment(size=5).tasks("train") != GuessEnvironment(size=5).tasks("test")
    assert GuessEnvironment(turns=4).interaction(tasks[0]).max_turns == 4


@pytest.mark.slow
def test_guess_learns_with_its_suggested_settings(tmp_path: Path) -> None:
    """Mean reward from below 0.3 to at least 0.8 (the mean of the last five iterations) with the
    environment's own defaults (GRPO, 30 iterations). About 45-60 s on the loaded 2-core machine."""
    from vrl.trainer import Trainer

    config = resolve_config({"plugin": "guess", "model": "tiny",
                                  "logging": {"runs_dir": str(tmp_path), "name": "guess", "samples_per_iteration": 2}})
    assert (config.optimizer, config.iterations) == ("grpo", 30)
    summary = Trainer(config, console=Console(file=io.StringIO())).run()
    assert summary["status"] == "finished"
    rows = [json.loads(line) for line in (tmp_path / "guess" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    assert rewards[0] < 0.3, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    assert rows[-1]["episodes/pass_rate_turn_3"] > rows[-1]["episodes/pass_rate_turn_1"]  # later guesses find it


def test_vrl_eval_plays_whole_games(monkeypatch) -> None:
    """`vrl eval` on a multi-turn environment evaluates episodes, as training samples them."""
    from click.testing import CliRunner

    from vrl.cli import main
    from vrl.episodes import Episodes

    played = []
    run = Episodes.run

    def spy(self, rows, *args):
        out = run(self, rows, *args)
        played.extend(c.episode.metrics["turns"] for c in out)
        return out

    monkeypatch.setattr(Episodes, "run", spy)
    res = CliRunner().invoke(main, ["eval", "--plugin", "guess", "--model", "tiny", "--limit", "3", "--k", "2", "--json",
                                    "-o", "turns=2", "--set", "sampling.max_new_tokens=2"])
    assert res.exit_code == 0, res.output
    assert set(json.loads(res.stdout)["pass_at"]) == {"1", "2"}
    assert len(played) == 6 and max(played) == 2
