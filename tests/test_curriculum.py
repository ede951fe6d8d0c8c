"""The pass-rate curriculum (curriculum.kind=pass_rate, `vrl.curriculum`, `vrl.schedule`): estimators,
band, minimum observations, re-admission, defective rows, the ES observation, a state rebuilt from
tasks.jsonl; then ES in the real loop retiring tasks and resuming bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.test_filtering import MixedEnvironment
from tests.test_filtering import _run as _train
from vrl.config import ConfigError, build
from vrl.curriculum import Curriculum
from vrl.errors import UsageError
from vrl.optim.es import informative_share, normalize
from vrl.rundir import RunDir
from vrl.schedule import TASKS_FILE, Schedule
from vrl.trainer import Trainer
from vrl.types import Completion, Result, Status, Task, Verdict

N = 4  # ES members


def _cur(**fields: Any) -> Curriculum:
    return Curriculum(build({"curriculum": {"kind": "pass_rate", **fields}}).curriculum)


@pytest.mark.parametrize("estimator, expected", [("last", 0.25), ("max", 1.0), ("ema", 0.5 * 0.25 + 0.25 * 1.0 + 0.25 * 0.5)])
def test_estimators(estimator, expected):
    cur = _cur(estimator=estimator, min_observations=1)
    for rate in (0.5, 1.0, 0.25):
        cur.observe("t", rate)
    assert cur.tasks["t"].estimate == pytest.approx(expected) and cur.tasks["t"].observations == 3


def test_ema_weight_is_the_weight_of_the_newest_observation():
    cur = _cur(ema_weight=0.9)
    cur.observe("t", 0.0)
    cur.observe("t", 1.0)
    assert cur.tasks["t"].estimate == pytest.approx(0.9)


def test_band_and_minimum_observations_retire_too_hard_and_too_easy_tasks():
    cur = _cur(min_observations=2, band_low=0.1, band_high=0.9, estimator="last")
    for tid, rate in (("hard", 0.0), ("easy", 0.95), ("mid", 0.5), ("edge", 0.9)):
        cur.observe(tid, rate)
    assert {t: cur.status(t) for t in ("hard", "easy", "mid", "edge")} == dict.fromkeys(("hard", "easy", "mid", "edge"), "active")
    for tid, rate in (("hard", 0.0), ("easy", 0.95), ("mid", 0.5), ("edge", 0.9)):
        cur.observe(tid, rate)
    assert [cur.status(t) for t in ("hard", "easy", "mid", "edge")] == ["retired_low", "retired_high", "active", "retired_high"]
    assert cur.counts(["hard", "easy", "mid", "edge", "unseen"]) == {
        "curriculum/active": 2.0, "curriculum/retired_low": 1.0, "curriculum/retired_high": 2.0,
        "curriculum/retired_defective": 0.0}
    cur.observe("hard", 0.5)  # a re-admitted task observed in the band is active again
    assert cur.status("hard") == "active"


def test_curriculum_options_are_checked_and_named():
    with pytest.raises(ConfigError, match="curriculum.readmit_prob only apply to a curriculum"):
        build({"curriculum": {"readmit_prob": 0.5}})
    with pytest.raises(ConfigError, match=r"curriculum.band_low \(0.5\) must be below curriculum.band_high \(0.5\)"):
        build({"curriculum": {"kind": "pass_rate", "band_low": 0.5, "band_high": 0.5}})
    with pytest.raises(ConfigError, match="ema_weight only applies to curriculum.estimator=ema"):
        build({"curriculum": {"kind": "pass_rate", "estimator": "max", "ema_weight": 0.2}})
    with pytest.raises(ConfigError, match="'last', 'ema' or 'max'"):
        build({"curriculum": {"kind": "pass_rate", "estimator": "median"}})
    with pytest.raises(ConfigError, match="'none' or 'pass_rate'"):
        build({"curriculum": {"kind": "uniform"}})


# -- the schedule with a curriculum, ES-shaped results (N members, one sample each) ------------------
class Members:
    """ES-shaped results: each task gets one attempt per member; `rates[task]` members pass (the first ones).
    A task in `broken` gets a verdict that marks its row defective, as Lean's does."""

    def __init__(self, rates: dict[str, int], broken: frozenset[str] = frozenset()):
        self.rates, self.broken, self.calls = rates, broken, []

    def __call__(self, tasks: list[Task], batch: int) -> list[Result]:
        self.calls.append([t.id for t in tasks])
        out = []
        for m in range(N):
            for t in tasks:
                c = Completion(task_id=t.id, text="x", variant=m, completion_tokens=1)
                if t.id in self.broken:
                    v = Verdict.fail(Status.FAILED, "defective task").model_copy(update={"metrics": {"lean/defective_statement": 1.0}})
                else:
                    v = Verdict.ok() if m < self.rates[t.id] else Verdict.fail(Status.FAILED, "no")
                out.append(Result(task=t, completion=c, verdict=v, reward=float(v.passed)))
        return out


def _es_config(**cur: Any):
    return build({"plugin": "letters", "optimizer": "es", "tasks_per_iteration": 2, "seed": 4,
                  "curriculum": {"kind": "pass_rate", **cur}})


POOL = [Task(id=f"t{i}", prompt=f"p{i}") for i in range(6)]


def test_the_es_observation_is_the_pass_rate_across_members_and_retired_tasks_are_skipped():
    rates = {"t0": 0, "t1": 4, "t2": 2, "t3": 1, "t4": 0, "t5": 3}
    sch = Schedule(_es_config(min_observations=1, readmit_prob=0.0), POOL)
    sampler = Members(rates)
    plans = [sch.collect(i, sampler) for i in range(6)]
    first = plans[0].rows
    assert [r["attempts"] for r in first] == [N, N] and [r["passed"] for r in first] == [rates[r["task_id"]] for r in first]
    assert sch.curriculum.tasks[first[0]["task_id"]].estimate == rates[first[0]["task_id"]] / N
    drawn_later = {tid for call in sampler.calls[3:] for tid in call}
    assert drawn_later <= {"t2", "t3", "t5"}  # t0, t4 never pass, t1 always: retired once seen
    last = plans[-1].metrics
    assert last["curriculum/retired_low"] == 2 and last["curriculum/retired_high"] == 1 and last["curriculum/active"] == 3
    assert all(p.trained == p.results for p in plans)  # no filter: every result trains


def test_retired_tasks_come_back_at_the_readmission_rate_deterministically():
    rates = {t.id: 0 for t in POOL}
    rates["t3"] = 2

    def run(p: float) -> tuple[list[list[str]], float]:
        sch = Schedule(_es_config(min_observations=1, readmit_prob=p), POOL)
        sampler = Members(rates)
        readmitted = sum(sch.collect(i, sampler).metrics["curriculum/readmitted"] for i in range(12))
        return sampler.calls, readmitted

    never_calls, never = run(0.0)
    assert never == 0 and {t for c in never_calls[3:] for t in c} == {"t3"}
    calls, some = run(0.5)
    assert some > 0 and run(0.5) == (calls, some)  # a pure function of the seed and the rows
    always_calls, always = run(1.0)
    assert always > some and all(len(c) == 2 for c in always_calls)


def test_a_defective_row_is_retired_at_once_and_never_readmitted():
    rates = {t.id: 2 for t in POOL}
    sch = Schedule(_es_config(min_observations=5, readmit_prob=1.0), POOL)
    sampler = Members(rates, broken=frozenset({"t1"}))
    plans = [sch.collect(i, sampler) for i in range(9)]
    first = next(i for i, call in enumerate(sampler.calls) if "t1" in call)
    assert all("t1" not in call for call in sampler.calls[first + 1:])
    assert sch.curriculum.status("t1") == "retired_defective" and plans[-1].metrics["curriculum/retired_defective"] == 1
    assert any(r["defective"] for p in plans for r in p.rows)


def test_every_task_retired_is_an_error_naming_the_curriculum():
    sch = Schedule(_es_config(min_observations=1, readmit_prob=0.0), POOL)
    sampler = Members({t.id: 0 for t in POOL})
    with pytest.raises(UsageError, match="every one is retired by curriculum.kind=pass_rate.*curriculum.readmit_prob"):
        for i in range(10):
            sch.collect(i, sampler)


def test_the_state_is_a_fold_over_tasks_jsonl(tmp_path: Path):
    """Three iterations in one go, or one, written to tasks.jsonl (with a torn iteration after it), loaded
    by a new schedule and two more: the same draws, rows and curriculum."""
    rates = {"t0": 0, "t1": 4, "t2": 2, "t3": 1, "t4": 0, "t5": 3}
    cfg = _es_config(min_observations=1, readmit_prob=0.3, estimator="ema")
    straight = Schedule(cfg, POOL)
    rows = [row for i in range(3) for row in straight.collect(i, Members(rates)).rows]
    run = SimpleNamespace(path=tmp_path)
    part = Schedule(cfg, POOL)
    written = part.collect(0, Members(rates)).rows + [{**rows[0], "iteration": 1, "position": 40}]
    (tmp_path / TASKS_FILE).write_text("".join(json.dumps(r) + "\n" for r in written))
    resumed = Schedule(cfg, POOL)
    resumed.load(run, 1)
    assert len((tmp_path / TASKS_FILE).read_text().splitlines()) == len(written) - 1  # the torn row is gone
    more = [row for i in (1, 2) for row in resumed.collect(i, Members(rates)).rows]
    assert written[:-1] + more == rows
    assert resumed.curriculum.tasks == straight.curriculum.tasks and resumed.cursor == straight.cursor


# -- ES: group normalisation over the tasks that carry signal --------------------------------------------
def test_es_group_normalisation_divides_by_the_tasks_that_carry_signal():
    """Two tasks, one that every member fails: the z of the other alone, not halved by the constant one."""
    per_task = [[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]  # members × tasks
    alone = normalize([0, 0, 0, 0], "group", [[row[1]] for row in per_task])
    assert normalize([0, 0, 0, 0], "group", per_task) == alone == [1.0, -1.0, 1.0, -1.0]
    assert informative_share(per_task) == 0.5
    noise = [[0.3, 1.0], [0.1 + 0.2, 0.0]]  # equal up to float64 noise: no signal
    assert informative_share(noise) == 0.5 and normalize([0, 0], "group", noise) == [1.0, -1.0]
    assert normalize([0, 0], "group", [[0.5], [0.5]]) == [0.0, 0.0]


# -- the real loop: ES with a curriculum ------------------------------------------------------------------
def _loop_config(tmp_path: Path, name: str, iterations: int = 5):
    return build({"plugin": "letters", "model": "tiny", "optimizer": "es", "iterations": iterations,
                  "tasks_per_iteration": 2, "seed": 2, "sampling": {"max_new_tokens": 4, "temperature": 1.0},
                  "es": {"population_size": N, "sigma": 0.05, "alpha": 0.05, "normalization": "group"},
                  "curriculum": {"kind": "pass_rate", "min_observations": 1, "readmit_prob": 0.25},
                  "logging": {"runs_dir": str(tmp_path), "name": name}})


def test_es_with_the_curriculum_retires_tasks_and_resumes_bit_for_bit(tmp_path: Path):
    straight = _train(_loop_config(tmp_path, "straight"))
    rows = straight.run_dir.metrics()
    assert len(rows) == 5
    assert rows[-1]["curriculum/retired_low"] > 0 and rows[-1]["curriculum/retired_high"] > 0
    assert all(0.0 <= m["es/informative_task_frac"] <= 1.0 for m in rows)
    drawn = [json.loads(line) for line in (straight.run_dir.path / TASKS_FILE).read_text().splitlines()]
    assert all(r["attempts"] == N for r in drawn) and len(drawn) == 10
    assert all(r["passed"] == N for r in drawn if r["task_id"].startswith("easy"))

    cfg = _loop_config(tmp_path, "resumed")
    first = _train(cfg, stop_after=2)
    assert first.run_dir.completed_iterations() == 2
    second = _train(cfg, run_dir=RunDir.open(first.run_dir.path))
    assert second.start_iteration == 2 and second.run_dir.completed_iterations() == 5
    for file in (TASKS_FILE, "es_history.json"):
        assert (second.run_dir.path / file).read_text() == (straight.run_dir.path / file).read_text(), file
    assert [m["reward_mean"] for m in second.run_dir.metrics()] == [m["reward_mean"] for m in rows]

    changed = _loop_config(tmp_path, "resumed", iterations=6)
    changed.curriculum.readmit_prob = 0.5
    with pytest.raises(UsageError, match="cannot resume with curriculum.readmit_prob=0.5"):
        Trainer(changed, run_dir=RunDir.open(first.run_dir.path), environment=MixedEnvironment())
