"""The command line, run in-process through click's runner against real components."""

import json

from click.testing import CliRunner

from vrl.cli import main

SMALL = ["--set", "tasks_per_iteration=2", "--set", "es.population_size=2", "--set", "sampling.max_new_tokens=8"]


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_help_is_useful_on_its_own():
    out = run("--help").output
    for word in ("train", "eval", "verify", "plugins", "vrl train --plugin lean"):
        assert word in out
    train_help = run("train", "--help").output
    for flag in ("--plugin", "--optimizer", "--model", "--config", "--set", "--resume"):
        assert flag in train_help


def test_train_writes_a_run(tmp_path):
    res = run("train", "--iterations", "2", "--name", "cli", "--set", f"logging.runs_dir={tmp_path}", *SMALL)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["plugin"] == "countdown"
    assert "iter 2" in res.output and "finished" in res.output


def test_train_reports_config_errors_clearly(tmp_path):
    res = CliRunner().invoke(main, ["train", "--set", "sampling.temprature=0.5"])
    assert res.exit_code == 2
    assert "sampling.temprature: unknown field" in res.output
    res = CliRunner().invoke(main, ["train", "--plugin", "no-such-env"])
    assert res.exit_code == 2 and "unknown environment 'no-such-env'" in res.output and "countdown" in res.output
    res = CliRunner().invoke(main, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 2 and "config file not found" in res.output


def test_verify_scores_lines_in_order_and_survives_bad_lines(tmp_path):
    lines = [
        json.dumps({"task": {"numbers": [3, 5, 7], "target": 22}, "completion": "<answer>3 * 5 + 7</answer>"}),
        "{not json",
        json.dumps({"task_id": "train-0", "completion": "<answer>1 + 1</answer>"}),
        "",
        json.dumps({"task_id": "no-such-task", "completion": "x"}),
        json.dumps({"task": {"numbers": [3, 5], "target": 8}}),
        json.dumps({"task": {"numbers": [3, 5], "target": 8}, "completion": "<answer>5 * 3</answer>"}),
    ]
    path = tmp_path / "attempts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(main, ["verify", str(path)])
    assert res.exit_code == 0, res.output
    out = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [o["line"] for o in out] == [1, 2, 3, 5, 6, 7]
    assert [o["status"] for o in out] == ["passed", "rejected", "failed", "rejected", "rejected", "failed"]
    assert "line 2: not JSON" in out[1]["detail"]
    assert "unknown task_id 'no-such-task'" in out[3]["detail"]
    assert 'missing "completion"' in out[4]["detail"]
    assert out[2]["task_id"] == "train-0"


def test_verify_reads_stdin_and_writes_a_file(tmp_path):
    line = json.dumps({"task": {"numbers": [1, 2], "target": 3}, "completion": "<answer>1+2</answer>"})
    res = CliRunner().invoke(main, ["verify", "-", "--out", str(tmp_path / "v.jsonl")], input=line + "\n")
    assert res.exit_code == 0
    assert json.loads((tmp_path / "v.jsonl").read_text())["passed"] is True


def test_eval_reports_pass_at_k():
    res = run("eval", "--k", "2", "--limit", "3", "--set", "sampling.max_new_tokens=8", "--json")
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["tasks"] == 3 and report["samples_per_task"] == 2
    assert set(report["pass_at"]) == {"1", "2"}
    assert sum(report["statuses"].values()) == 6
    assert 0.0 <= report["pass_at"]["1"] <= report["pass_at"]["2"] <= 1.0


def test_pass_at_k_estimator():
    from vrl.evaluate import pass_at_k

    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert abs(pass_at_k(4, 1, 2) - 0.5) < 1e-12  # 1 - C(3,2)/C(4,2)


def test_config_takes_trains_flags_and_prints_what_train_uses(tmp_path):
    import yaml

    flags = ["--plugin", "letters", "--optimizer", "es", "--iterations", "1", "--name", "same", "-o", "size=5",
             "--runtime", "local", "--set", f"logging.runs_dir={tmp_path}", *SMALL]
    shown = run("config", *flags)
    assert shown.exit_code == 0, shown.output
    printed = yaml.safe_load(shown.stdout)
    assert (printed["iterations"], printed["logging"]["name"], printed["env_options"]) == (1, "same", {"size": 5})
    trained = run("train", *flags)
    assert trained.exit_code == 0, trained.output
    used = json.loads((tmp_path / "same" / "config.json").read_text())
    assert json.loads(json.dumps(printed, default=str)) == used


def test_hf_generator_sets_cpu_threads_from_config(monkeypatch):
    """generator.hf.threads is applied when the model loads; None means 1 for the tiny model on CPU only."""
    import torch

    from vrl.config import build
    from vrl.generate.hf import HFGenerator, cpu_threads

    assert cpu_threads(None, "tiny", torch.device("cpu")) == 1
    assert cpu_threads(None, "Qwen/Qwen2.5-0.5B", torch.device("cpu")) is None  # torch's default is kept
    assert cpu_threads(None, "tiny", torch.device("cuda")) is None
    assert cpu_threads(3, "Qwen/Qwen2.5-0.5B", torch.device("cpu")) == 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        HFGenerator.from_config(build({"generator": {"device": "cpu"}}))
        assert torch.get_num_threads() == 1
        HFGenerator.from_config(build({"generator": {"device": "cpu", "hf": {"threads": 2}}}))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
