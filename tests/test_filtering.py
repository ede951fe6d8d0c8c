"""Dynamic sampling (grpo.filter_groups, `vrl.filtering`, `vrl.schedule`): each pitfall of issue 58 on a
scripted sampler (no model), then the real loop with the tiny model: every trained group informative,
the filter/* metrics and tasks.jsonl written, and a resumed run equal to the uninterrupted one."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from vrl.config import ConfigError, build
from vrl.envs.letters import LettersEnvironment, LettersVerifier
from vrl.errors import UsageError
from vrl.rundir import RunDir
from vrl.schedule import Schedule, check
from vrl.trainer import Trainer
from vrl.types import Attempt, Completion, Result, Status, Task, Verdict

G = 4


def _config(k: int = 2, **grpo: Any):
    return build({"plugin": "letters", "optimizer": "grpo", "tasks_per_iteration": k, "seed": 5,
                  "grpo": {"num_generations": G, "filter_groups": True, **grpo}})


def _pool(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"task {i}") for i in range(n)]


class Scripted:
    """A sampler whose verdicts are a table: task id -> G (passed, score, format bonus) per sample; the
    reward is countdown's shape, passed + 0.1 × format bonus. Records each call's tasks."""

    def __init__(self, table: dict[str, list[tuple[bool, float, float]]]):
        self.table, self.calls = table, []

    def __call__(self, tasks: list[Task], batch: int) -> list[Result]:
        self.calls.append(([t.id for t in tasks], batch))
        out = []
        for t in tasks:
            for s, (passed, score, bonus) in enumerate(self.table[t.id]):
                c = Completion(task_id=t.id, text=f"{t.id}/{s}", sample=s, completion_tokens=3,
                               token_ids=[hash((t.id, s)) % 97, s], prompt_token_ids=[1])
                v = Verdict.ok() if passed else Verdict.fail(Status.FAILED, "no", score=score)
                out.append(Result(task=t, completion=c, verdict=v, reward=float(passed) + 0.1 * bonus))
        return out


def _rows(outcomes: list[int], bonus: float = 0.0) -> list[tuple[bool, float, float]]:
    return [(bool(o), float(o), bonus) for o in outcomes]


MIXED, FAIL, PASS = [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]


def test_a_group_is_kept_or_dropped_whole_never_split():
    """[1, 0, 0, 0] is informative: all four samples train, the one pass included (a row mask would make it
    [0, 0, 0, 0]); an all-fail group is dropped with all its samples."""
    pool = _pool(4)
    sampler = Scripted({"t0": _rows(MIXED), "t1": _rows(FAIL), "t2": _rows([0, 1, 1, 1]), "t3": _rows(FAIL)})
    plan = Schedule(_config(k=2, gen_batch_multiplier=2.0), pool).collect(0, sampler)
    trained = {}
    for r in plan.trained:
        trained.setdefault(r.task.id, []).append(r.verdict.passed)
    assert trained == {"t0": [True, False, False, False], "t2": [False, True, True, True]}
    assert len(plan.results) == 4 * G and len(plan.trained) == 2 * G
    why = {row["task_id"]: (row["kept"], row["why"], row["passed"]) for row in plan.rows}
    assert why == {"t0": (True, None, 1), "t1": (False, "all_fail", 0), "t2": (True, None, 3), "t3": (False, "all_fail", 0)}


def test_the_shaped_reward_does_not_let_all_wrong_groups_through():
    """countdown's Binary + 0.1 × FormatBonus: an all-wrong group whose format bonus differs has a varying
    reward. The default metric (passed) drops it; only the documented-unsafe 'reward' keeps it."""
    pool = _pool(2)
    wrong_formats = [(False, 0.0, b) for b in (0.0, 1.0, 0.0, 1.0)]
    table = {"t0": wrong_formats, "t1": _rows(MIXED)}
    raw = Schedule(_config(k=1, gen_batch_multiplier=2.0), pool).collect(0, Scripted(table))
    assert {r.task.id for r in raw.trained} == {"t1"}
    assert [row["why"] for row in raw.rows if row["task_id"] == "t0"] == ["all_fail"]
    shaped = Schedule(_config(k=2, filter_groups_metric="reward"), pool).collect(0, Scripted(table))
    assert {r.task.id for r in shaped.trained} == {"t0", "t1"}  # what filtering on the shaped reward trains


def test_the_trained_batch_is_aligned_whole_groups_in_schedule_order():
    """Exactly k groups, each with its G samples in order, every completion with its own task, verdict,
    reward and token ids (nothing re-indexed after filtering)."""
    pool = _pool(8)
    table = {t.id: _rows(MIXED if i % 2 else FAIL) for i, t in enumerate(pool)}
    sampler = Scripted(table)
    cfg = _config(k=3, gen_batch_multiplier=2.0)
    plan = Schedule(cfg, pool).collect(0, sampler)
    generated = {(r.task.id, r.completion.sample): r for r in plan.results}
    assert len(plan.trained) == 3 * G
    kept_order = [row["task_id"] for row in plan.rows if row["kept"]]
    assert [plan.trained[i * G].task.id for i in range(3)] == kept_order
    for i, r in enumerate(plan.trained):
        assert r.completion.task_id == r.task.id == kept_order[i // G] and r.completion.sample == i % G
        assert r is generated[(r.task.id, r.completion.sample)]
        assert r.verdict.passed == bool(table[r.task.id][r.completion.sample][0])
        assert r.completion.token_ids == [hash((r.task.id, r.completion.sample)) % 97, r.completion.sample]
    drawn_order = [row["task_id"] for row in plan.rows]
    assert drawn_order == [tid for ids, _ in sampler.calls for tid in ids]  # rows follow the schedule


def test_scores_equal_up_to_float_noise_are_a_constant_group():
    """0.1 + 0.2 and 0.3 differ in float64; the filter compares scores with a tolerance."""
    pool = _pool(3)
    noisy = [(False, s, 0.0) for s in (0.3, 0.1 + 0.2, 0.3, 0.3)]
    apart = [(False, s, 0.0) for s in (0.3, 0.3, 0.3, 0.31)]
    table = {"t0": noisy, "t1": apart, "t2": _rows(FAIL)}
    plan = Schedule(_config(k=1, filter_groups_metric="score", gen_batch_multiplier=3.0), pool).collect(0, Scripted(table))
    assert {row["task_id"]: row["outcome"] for row in plan.rows} == {"t0": "all_fail", "t1": "mixed", "t2": "all_fail"}
    assert {r.task.id for r in plan.trained} == {"t1"}


def test_informative_groups_past_the_batch_are_counted_not_silently_dropped():
    pool = _pool(6)
    plan = Schedule(_config(k=2, gen_batch_multiplier=3.0), pool).collect(0, Scripted({t.id: _rows(MIXED) for t in pool}))
    assert len(plan.trained) == 2 * G
    assert plan.metrics["filter/surplus_groups"] == 4 and plan.metrics["filter/trained_groups"] == 2
    assert [row["why"] for row in plan.rows].count("surplus") == 4
    assert plan.metrics["filter/informative_frac"] == 1.0
    assert plan.metrics["tokens_discarded"] == 4 * G * 3


def test_further_generation_batches_until_k_groups_then_the_next_iteration_starts_after_them():
    pool = _pool(12)
    table = {t.id: _rows(FAIL) for t in pool}
    sch = Schedule(_config(k=2), pool)
    first_two = [sch.task_at(p).id for p in range(2)]
    for tid in [sch.task_at(p).id for p in range(2, 6)]:
        table[tid] = _rows(MIXED)
    sampler = Scripted(table)
    plan = sch.collect(0, sampler)
    assert [b for _, b in sampler.calls] == [0, 1] and sampler.calls[0][0] == first_two
    assert plan.metrics["filter/gen_batches"] == 2 and plan.metrics["filter/all_fail_groups"] == 2
    assert plan.metrics["filter/informative_frac"] == 0.5 and plan.metrics["filter/exhausted"] == 0
    assert sch.cursor == 4  # the next iteration draws from position 4 on
    again = Scripted(table)
    sch.collect(1, again)
    assert again.calls[0][0] == [sch.task_at(p).id for p in (4, 5)]


@pytest.mark.parametrize("outcome, words", [(FAIL, "too hard"), (PASS, "too easy")])
def test_the_bound_stops_with_an_error_that_names_the_data(outcome, words):
    pool = _pool(20)
    sampler = Scripted({t.id: _rows(outcome) for t in pool})
    with pytest.raises(UsageError, match=rf"{words}.*") as err:
        Schedule(_config(k=2, max_num_gen_batches=3), pool).collect(7, sampler)
    assert len(sampler.calls) == 3  # bounded: no fourth generation batch
    assert "iteration 7" in str(err.value) and "grpo.max_num_gen_batches=3" in str(err.value)
    assert "found 0 of the 2" in str(err.value)


def test_at_the_bound_train_trains_on_the_groups_found():
    pool = _pool(20)
    table = {t.id: _rows(FAIL) for t in pool}
    sch = Schedule(_config(k=3, max_num_gen_batches=2, filter_groups_exhausted="train"), pool)
    table[sch.task_at(1).id] = _rows(MIXED)
    plan = sch.collect(0, Scripted(table))
    assert {r.task.id for r in plan.trained} == {sch.task_at(1).id}
    assert plan.metrics["filter/exhausted"] == 1 and plan.metrics["filter/trained_groups"] == 1
    nothing = Schedule(_config(k=3, max_num_gen_batches=2, filter_groups_exhausted="train"), pool)
    with pytest.raises(UsageError, match="too hard"):  # none found: never a silent fallback to the unfiltered batch
        nothing.collect(0, Scripted({t.id: _rows(FAIL) for t in pool}))


def test_a_task_is_drawn_once_per_iteration_so_groups_never_merge():
    """A pool smaller than the generation batch: the second turn of a task in the same iteration is
    skipped, so no group holds 2G samples and no two trained groups share a task id."""
    pool = _pool(3)
    sampler = Scripted({t.id: _rows(MIXED) for t in pool})
    plan = Schedule(_config(k=2, gen_batch_multiplier=4.0), pool).collect(0, sampler)
    ids = [row["task_id"] for row in plan.rows]
    assert sorted(ids) == ["t0", "t1", "t2"] and all(row["attempts"] == G for row in plan.rows)


def test_filter_options_are_checked_and_named():
    with pytest.raises(ConfigError, match="grpo.filter_groups=true"):
        build({"optimizer": "grpo", "grpo": {"gen_batch_multiplier": 2.0}})
    with pytest.raises(ConfigError, match="max_num_gen_batches"):
        build({"optimizer": "grpo", "grpo": {"filter_groups": True, "max_num_gen_batches": 0}})
    with pytest.raises(ConfigError, match="passed', 'score' or 'reward'"):
        build({"optimizer": "grpo", "grpo": {"filter_groups": True, "filter_groups_metric": "advantage"}})
    with pytest.raises(ConfigError, match="'stop' or 'train'"):
        build({"optimizer": "grpo", "grpo": {"filter_groups": True, "filter_groups_exhausted": "skip"}})
    with pytest.raises(UsageError, match="grpo.filter_groups=true filters grpo's groups; optimizer=es"):
        check(build({"optimizer": "es", "grpo": {"filter_groups": True}}))
    with pytest.raises(UsageError, match="grpo.max_staleness=1 samples iterations ahead.*set grpo.max_staleness=0"):
        check(build({"optimizer": "grpo", "grpo": {"filter_groups": True, "max_staleness": 1}}))
    recorded = json.loads(json.dumps(build({"optimizer": "grpo"}).model_dump(mode="json")))
    with pytest.raises(UsageError, match="cannot resume with grpo.filter_groups=True.*grpo.filter_groups=False"):
        check(_config(), recorded)
    check(build({"optimizer": "grpo"}), recorded)


# -- the real loop --------------------------------------------------------------------------------------
class MixedVerifier(LettersVerifier):
    """easy-* tasks always pass, hard-* never, mid-* when the sum of the completion's bytes is even."""

    def check(self, attempt: Attempt) -> Verdict:
        tid, text = attempt.task.id, attempt.completion.text
        if tid.startswith("easy") or (tid.startswith("mid") and sum(text.encode()) % 2 == 0):
            return Verdict.ok("ok")
        return Verdict.fail(Status.FAILED, "no", score=0.0)


class MixedEnvironment(LettersEnvironment):
    """A lean_workbook-like mix: always-, never- and sometimes-solved tasks, reward = pass + 0.1 × letters share."""

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        return [Task(id=f"{kind}-{i}", prompt=f"Task {kind} {i}: write letters.\n")
                for i in range(4) for kind in ("easy", "hard", "mid")]

    def verifier(self) -> MixedVerifier:
        return MixedVerifier()

    def shaper(self):
        def shape(task, completion, verdict):
            text = completion.text
            return float(verdict.passed) + 0.1 * (sum(ch.isalpha() for ch in text) / len(text) if text else 0.0)
        return shape


def _loop_config(tmp_path, name: str, iterations: int = 3, **extra: Any):
    return build({"plugin": "letters", "optimizer": "grpo", "iterations": iterations, "tasks_per_iteration": 2,
                  "seed": 1, "sampling": {"max_new_tokens": 6, "temperature": 1.0},
                  "grpo": {"num_generations": G, "learning_rate": 1e-2, "micro_batch_size": 8, "save_every": 1,
                           "filter_groups": True, "gen_batch_multiplier": 1.5, "max_num_gen_batches": 8},
                  "curriculum": {"kind": "pass_rate", "min_observations": 1, "readmit_prob": 0.2},
                  "logging": {"runs_dir": str(tmp_path), "name": name}, **extra})


def _run(cfg, run_dir: RunDir | None = None, stop_after: int | None = None) -> Trainer:
    def interrupt(metrics):
        if stop_after is not None and metrics["iteration"] + 1 == stop_after:
            raise KeyboardInterrupt

    trainer = Trainer(cfg, run_dir=run_dir, environment=MixedEnvironment(), console=Console(file=io.StringIO()),
                      on_iteration=interrupt)
    trainer.run()
    return trainer


def test_the_loop_trains_only_informative_groups_and_resumes_exactly(tmp_path):
    """With grpo.filter_groups=true and a curriculum, every trained group has a non-constant raw outcome (so GRPO's
    frac_reward_zero_std is 0 although the shaped reward varies in all-wrong groups), the filter/* metrics
    and tasks.jsonl are written, and a run stopped after iteration 1 and resumed ends with the same
    weights, metrics and tasks.jsonl as the uninterrupted run (tasks.jsonl truncated like metrics.jsonl)."""
    straight = _run(_loop_config(tmp_path, "straight"))
    rows = straight.run_dir.metrics()
    assert len(rows) == 3
    for m in rows:
        assert m["grpo/frac_reward_zero_std"] == 0.0 and m["filter/trained_groups"] == 2
        assert m["filter/all_pass_groups"] + m["filter/all_fail_groups"] > 0 or m["filter/informative_frac"] == 1
        assert m["tokens_discarded"] <= m["tokens"]
    assert sum(m["filter/all_pass_groups"] + m["filter/all_fail_groups"] for m in rows) > 0  # easy and hard were drawn
    tasks = [json.loads(line) for line in (straight.run_dir.path / "tasks.jsonl").read_text().splitlines()]
    assert all(not r["task_id"].startswith(("easy", "hard")) or not r["kept"] for r in tasks)
    assert sum(r["kept"] for r in tasks) == 6
    assert rows[-1]["curriculum/retired_low"] + rows[-1]["curriculum/retired_high"] > 0

    cfg = _loop_config(tmp_path, "resumed")
    first = _run(cfg, stop_after=2)
    assert first.run_dir.completed_iterations() == 2
    with open(first.run_dir.path / "tasks.jsonl", "a") as f:  # a crash after the rows of an unfinished iteration
        f.write(json.dumps({**tasks[-1], "iteration": 2, "position": 999}) + "\n")
    second = _run(cfg, run_dir=RunDir.open(first.run_dir.path))
    assert second.start_iteration == 2 and second.run_dir.completed_iterations() == 3
    assert (second.run_dir.path / "tasks.jsonl").read_text() == (straight.run_dir.path / "tasks.jsonl").read_text()
    assert [m["reward_mean"] for m in second.run_dir.metrics()] == [m["reward_mean"] for m in rows]
    a = load_file(str(straight.run_dir.path / "grpo" / "iter-000003" / "policy" / "model.safetensors"))
    b = load_file(str(second.run_dir.path / "grpo" / "iter-000003" / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from vrl.report import render  # vrl report plots the informative fraction of such runs

    page = render([straight.run_dir.path], tmp_path / "report").read_text()
    assert "<h2>Informative fraction</h2>" in page and (tmp_path / "report" / "informative.png").stat().st_size > 5000

    changed = _loop_config(tmp_path, "resumed", iterations=4)
    changed.grpo.gen_batch_multiplier = 2.0
    with pytest.raises(UsageError, match="cannot resume with grpo.gen_batch_multiplier=2.0"):
        Trainer(changed, run_dir=RunDir.open(first.run_dir.path), environment=MixedEnvironment())
