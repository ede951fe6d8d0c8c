"""Repair episodes (`vrl.repair`): the episode's verdict is the one its last turn already got from the run's
verifier, not a second verification of the same text (for Lean a second compile and re-check), while the run's
alarms and the verifier's counters still see every verdict, passes included."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

import vrl
from vrl.envs.letters import LettersEnvironment
from vrl.errors import IntegrityAlarm
from vrl.repair import RepairEpisodes
from vrl.types import Attempt, Status, Verdict
from vrl.verifier import SimpleVerifier

SEEN: Counter[tuple[str, str]] = Counter()  # (task id, text) -> times the verifier judged it
LOCK = threading.Lock()


class Picky(SimpleVerifier):
    """Passes a text whose bytes sum to a multiple of 4 (a quarter of the random model's turns), counts
    every check, and reports a canary per check as a Lean verifier does (`lean/canaries`)."""

    alarm_on_pass = False

    def check(self, attempt: Attempt) -> Verdict:
        with LOCK:
            SEEN[(attempt.task.id, attempt.completion.text)] += 1
        if sum(attempt.completion.text.encode()) % 4 == 0:
            verdict = Verdict.ok("bytes sum to a multiple of 4")
            if self.alarm_on_pass:
                verdict.alarm = "a canary passed"
        else:
            verdict = Verdict.fail(Status.FAILED, f"{len(attempt.completion.text)} characters")
        verdict.metrics = {"picky/canaries": 1.0}
        return verdict


class RepairLetters(RepairEpisodes, LettersEnvironment):
    name = "repair-letters"

    def __init__(self, alarm: bool = False, **options):
        super().__init__(**options)
        self.turns, self.alarm = 3, alarm

    def verifier(self):
        v = Picky()
        v.alarm_on_pass = self.alarm
        return v


def _train(tmp_path: Path, alarm: bool = False) -> vrl.Trainer:
    SEEN.clear()
    config = vrl.TrainConfig(plugin="letters", model="tiny", optimizer="grpo", iterations=2, tasks_per_iteration=4,
                             sampling={"max_new_tokens": 3}, grpo={"num_generations": 4},
                             logging={"runs_dir": str(tmp_path), "name": "repair", "samples_per_iteration": 100})
    return vrl.Trainer(config, environment=RepairLetters(alarm=alarm))


def test_a_repair_episodes_last_verdict_is_not_judged_again(tmp_path: Path) -> None:
    trainer = _train(tmp_path)
    assert trainer.run()["status"] == "finished"
    import json

    samples = [json.loads(x) for x in (tmp_path / "repair" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
    turns = [len([t for t in s["episode"]["turns"] if t["role"] == "assistant"]) for s in samples]
    assert max(turns) > 1 and any(s["verdict"]["passed"] for s in samples)  # repairs happened, and passes
    for s in samples:  # the verdict the episode's last turn got, once: never a second check of the same text
        last = [t["content"] for t in s["episode"]["turns"] if t["role"] == "assistant"][-1]
        assert s["completion"] == last
        assert SEEN[(s["task_id"], last)] >= 1
        assert s["verdict"]["passed"] == (sum(last.encode()) % 4 == 0)
    checks = sum(SEEN.values())
    assert checks == sum(turns)  # one check per model turn, the last included; none by the pool
    metrics = [json.loads(x) for x in (tmp_path / "repair" / "metrics.jsonl").read_text().splitlines()]
    assert [m["picky/canaries"] for m in metrics] == [16.0, 16.0]  # each final verdict's counters, as before


def test_a_pass_that_breaks_the_verifiers_integrity_in_an_episode_still_stops_the_run(tmp_path: Path) -> None:
    trainer = _train(tmp_path, alarm=True)
    with pytest.raises(IntegrityAlarm, match="a canary passed"):
        trainer.run()
    assert (tmp_path / "repair" / "alarms.jsonl").exists()
