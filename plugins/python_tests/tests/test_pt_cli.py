"""The plugin through `vrl`'s command line (click's runner, in-process): verify a JSONL file, train one iteration."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import needs_bwrap

from vrl.cli import main

pytestmark = needs_bwrap


def test_vrl_verify_judges_a_file(tmp_path):
    lines = [
        {"task_id": "pt-001", "completion": "```python\ndef count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n```"},
        {"task_id": "pt-001", "completion": "def count_vowels(s):\n    return 2\n"},
        {"task": {"entry_point": "add", "tests": ["assert add(1, 2) == 3"]}, "completion": "def add(a, b): return a + b"},
        {"task_id": "pt-999", "completion": "x"},
        "not an object",
    ]
    path = tmp_path / "attempts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["verify", "--plugin", "python-tests", str(path), "-o", "workers=1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["status"] for r in rows] == ["passed", "failed", "passed", "rejected", "rejected"]
    assert rows[1]["score"] == pytest.approx(0.2)
    assert "unknown task_id 'pt-999'" in rows[3]["detail"]


@pytest.mark.slow
def test_vrl_train_one_iteration(tmp_path):
    """`vrl train` in-process (click's runner), as `vrl verify` above: what it checks is the run directory
    (metrics, the resolved configuration), which does not depend on a process of its own; the candidates
    still run in the plugin's real sandbox. In-process it skips a torch + transformers start-up."""
    runs = tmp_path / "runs"
    result = CliRunner().invoke(main, [
        "train", "--plugin", "python-tests", "--iterations", "1", "--set", "tasks_per_iteration=2",
        "--set", "es.population_size=2", "--set", "sampling.max_new_tokens=16", "--set", f"logging.runs_dir={runs}",
        "--name", "e2e", "-o", "workers=1", "-o", "reward=partial"])
    assert result.exit_code == 0, result.output[-3000:]
    metrics = [json.loads(line) for line in (runs / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["iteration"] == 0
    assert metrics[0]["completions"] == 4  # 2 tasks x 2 population members
    statuses = sum(metrics[0][f"status/{s}"] for s in ("passed", "failed", "timeout", "crashed", "rejected"))
    assert statuses == 4
    config = json.loads((runs / "e2e" / "config.json").read_text())
    assert config["plugin"] == "python-tests" and config["env_options"] == {"workers": 1, "reward": "partial"}
    assert config["sampling"]["max_new_tokens"] == 16  # the command line beat the environment default (384)
