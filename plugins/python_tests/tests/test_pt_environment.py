"""The environment: options, splits, loaders for MBPP/HumanEval files, shapers, and the plugin hooks."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import BWRAP_PROBLEM, attempt, needs_bwrap
from vrl_python_tests.datasets import DatasetError, load_source, mbpp_split
from vrl_python_tests.environment import PythonTestsEnvironment
from vrl_python_tests.harness import decode
from vrl_python_tests.verifier import PythonTestsVerifier

from vrl.plugins import registry
from vrl.reward import Binary, PartialCredit
from vrl.types import Completion, Status, Task, Verdict

# Rows in the public formats, written for these tests (MBPP and HumanEval keys, invented content).
MBPP_ROWS = [
    {"task_id": 11, "text": "Write a function to triple a number.", "code": "def triple(x):\n    return 3 * x\n",
     "test_list": ["assert triple(2) == 6", "assert triple(0) == 0", "assert triple(-1) == -3"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 700, "text": "Write a function to reverse a list.", "code": "def rev(xs):\n    return xs[::-1]\n",
     "test_list": ["assert rev([1, 2]) == [2, 1]", "assert rev([]) == []"], "test_setup_code": "",
     "challenge_test_list": ["assert rev([1]) == [1]"]},
    {"task_id": 701, "text": "Unsupported: uses a name.", "code": "def f(x):\n    return x\n",
     "test_list": ["assert f(x) == 1"], "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 702, "text": "Needs setup code.", "code": "def g():\n    return 1\n",
     "test_list": ["assert g() == 1"], "test_setup_code": "import os", "challenge_test_list": []},
]
HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Add two numbers.\n    >>> add(1, 2)\n    3\n    """\n',
    "canonical_solution": "    return a + b\n",
    "test": "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def env(**kw) -> PythonTestsEnvironment:
    kw.setdefault("sandbox", "unsafe-local" if BWRAP_PROBLEM else "bwrap")
    return PythonTestsEnvironment(**kw)


def test_registered_class_exposes_defaults_to_the_cli():
    reg = registry()
    factory = reg.factory("environments", "python-tests")
    assert factory is PythonTestsEnvironment
    assert factory.defaults["sampling.max_new_tokens"] == 384
    verifier = PythonTestsVerifier(sandbox="unsafe-local", workers=1)
    assert isinstance(verifier, PythonTestsVerifier) and verifier.pool.workers == 1
    verifier.close()


def test_bundled_splits_and_limit():
    e = env()
    assert e.splits == ("train", "test")
    train, test = e.tasks("train"), e.tasks("test")
    assert len(train) + len(test) >= 40 and len(test) >= 10
    assert not {t.id for t in train} & {t.id for t in test}
    assert [t.id for t in e.tasks("train", limit=3)] == [t.id for t in train[:3]]
    with pytest.raises(ValueError, match="no split 'validation'"):
        e.tasks("validation")


def test_reward_option_picks_the_shaper():
    assert isinstance(env().shaper(), Binary)
    shaper = env(reward="partial").shaper()
    assert isinstance(shaper, PartialCredit)
    task = Task(id="x", prompt="p")
    assert shaper(task, Completion(task_id="x", text=""), Verdict.fail(Status.FAILED, "", score=0.6)) == 0.6
    with pytest.raises(ValueError, match="-o reward='dense': Input should be 'binary' or 'partial'"):
        env(reward="dense")


def test_mbpp_file_with_visible_tests_and_splits(tmp_path, caplog):
    path = write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS)
    with caplog.at_level(logging.WARNING):
        e = env(tasks=str(path), visible_tests=2)
    assert "skipped 2 task(s)" in caplog.text and "not a literal: x" in caplog.text
    assert set(e.splits) == {"train", "test"}
    (t3,) = e.tasks("test")
    assert t3.id == "mbpp-11" and t3.data["entry_point"] == "triple"
    assert [t["hidden"] for t in t3.data["tests"]] == [False, False, True]
    assert "assert triple(2) == 6" in t3.prompt and "assert triple(-1) == -3" not in t3.prompt
    (t700,) = e.tasks("train")
    assert len(t700.data["tests"]) == 3  # challenge tests included, hidden
    assert [mbpp_split(i) for i in (1, 11, 511, 601)] == ["prompt", "test", "validation", "train"]


def test_format_option_forces_a_format(tmp_path):
    path = write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS[:2])
    with pytest.raises(DatasetError, match="no usable task"):
        load_source(str(path), "humaneval")
    with pytest.raises(ValueError, match="-o format='apps': Input should be 'auto', 'vrl', 'mbpp' or 'humaneval'"):
        env(tasks=str(path), format="apps")
    assert len(env(tasks=str(path), format="mbpp").tasks("train")) == 1


def test_humaneval_jsonl_and_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    jsonl = write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL_ROW])
    parquet = tmp_path / "he.parquet"
    pq.write_table(pa.Table.from_pylist([HUMANEVAL_ROW]), parquet)
    for path in (jsonl, parquet):
        e = env(tasks=str(path))
        assert e.splits == ("test",)
        (task,) = e.tasks("test")
        assert task.id == "HumanEval/0" and all(t["hidden"] for t in task.data["tests"])
        assert task.data["prefix"] == HUMANEVAL_ROW["prompt"] and "def add(a: int" in task.prompt
        assert "candidate(-1, 1)" not in task.prompt


@needs_bwrap
def test_humaneval_body_only_completion_is_completed_with_the_prompt(tmp_path):
    e = env(tasks=str(write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL_ROW])))
    (task,) = e.tasks("test")
    v = e.verifier()
    try:
        assert v.judge(attempt(task, "    return a + b\n")).verdict.passed
        assert v.judge(attempt(task, task.data["solution"])).verdict.passed
        assert not v.judge(attempt(task, "    return a * b\n")).verdict.passed
    finally:
        v.close()


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="task file not found"):
        env(tasks=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"id": "a", "entry_point": "f", "tests": ["assert f() == 1"]}\n[1]\n')
    e = env(tasks=str(bad))
    assert [t.id for t in e.tasks("train")] == ["a"]  # the good row survives its bad neighbours


def test_hub_source(monkeypatch):
    """The Hub cannot be reached from this machine, so `datasets.load_dataset` is replaced by stand-ins."""
    datasets = pytest.importorskip("datasets")

    def offline(path, name=None):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DatasetError, match="download it as JSONL or parquet"):
        load_source("hf:mbpp")
    calls = []

    def fake(path, name=None):
        calls.append((path, name))
        return {"test": MBPP_ROWS[:1], "train": MBPP_ROWS[1:2]}

    monkeypatch.setattr(datasets, "load_dataset", fake)
    tasks = load_source("hf:mbpp:full")
    assert calls == [("mbpp", "full")]
    assert [t.id for t in tasks] == ["mbpp-11", "mbpp-700"]


def test_task_from_data_accepts_rows_and_prepared_tasks():
    e = env()
    task = e.task_from_data({"entry_point": "add", "tests": ["assert add(1, 2) == 3"]})
    assert task.data["entry_point"] == "add" and decode(task.data["tests"][0]["expected"]) == 3
    again = e.task_from_data(task.model_dump())
    assert again == task
    mbpp = e.task_from_data(MBPP_ROWS[0])
    assert mbpp.id == "mbpp-11"
    with pytest.raises(ValueError, match="unknown task format"):
        e.task_from_data({"question": "?"})


def test_workers_and_timeouts_reach_the_verifier():
    e = env(workers=1, test_timeout_s=0.5, attempt_timeout_s=3, memory_mb=256, max_processes=4)
    v = e.verifier()
    try:
        assert (v.pool.workers, v.test_timeout_s, v.attempt_timeout_s) == (1, 0.5, 3.0)
        assert (v.config.memory_mb, v.config.max_processes) == (256, 4)
    finally:
        v.close()
