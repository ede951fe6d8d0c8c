"""`vrl export` and `vrl eval --model <run dir>`: the exported folder generates what the trained model did.

Each test trains the tiny model on `letters` for a few iterations with the real Trainer, keeps the
generator the run sampled with (its model holds the trained policy at the end), and compares its
greedy completions with those of the exported Hugging Face folder, loaded the standard way, and with
what `vrl eval` generates from the folder and from the run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vrl.cli import main
from vrl.config import SamplingConfig, build, nest
from vrl.envs.letters import TARGET, LettersEnvironment
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator, load_model_and_tokenizer
from vrl.rundir import RunDir
from vrl.trainer import Trainer

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=16, batch_size=32)
TASKS = LettersEnvironment().tasks("test", limit=6)


def train(tmp_path, monkeypatch, optimizer: str, **sections) -> tuple:
    """Train on letters; return the run directory and the generator that sampled (the trained policy)."""
    live: list[HFGenerator] = []
    monkeypatch.setattr(HFGenerator, "close", lambda self: live.append(self))
    layers = {"plugin": "letters", "optimizer": optimizer, "iterations": 3, "tasks_per_iteration": 2,
              "logging": {"runs_dir": str(tmp_path / "runs"), "name": optimizer}, **sections}
    cfg = build(nest(LettersEnvironment.defaults), layers)
    summary = Trainer(cfg, environment=LettersEnvironment()).run()
    assert summary["status"] == "finished" and len(live) == 1
    monkeypatch.undo()
    return tmp_path / "runs" / optimizer, live[0]


def greedy(generator: HFGenerator) -> list[str]:
    generator.sampling = GREEDY
    return [c.text for c in generator.generate(TASKS, n=1)]


def from_folder(path) -> list[str]:
    model, tokenizer = load_model_and_tokenizer(str(path), "cpu", "float32")
    return greedy(HFGenerator(model, tokenizer, GREEDY))


def eval_texts(monkeypatch, model: str, *extra: str) -> tuple[list[str], dict]:
    """`vrl eval --model MODEL` (greedy, the TASKS), recording what its generator produced."""
    seen: list = []
    original = HFGenerator._generate_batch

    def spy(self, *args, **kwargs):
        batch = original(self, *args, **kwargs)
        seen.extend(batch)
        return batch

    monkeypatch.setattr(HFGenerator, "_generate_batch", spy)
    res = CliRunner().invoke(main, ["eval", "--model", model, *extra, "--limit", str(len(TASKS)), "--json",
                                    "--set", "sampling.temperature=0", "--set", "sampling.max_new_tokens=16"])
    monkeypatch.undo()
    assert res.exit_code == 0, res.output
    by_id = {c.task_id: c.text for c in seen}
    return [by_id[t.id] for t in TASKS], json.loads(res.stdout.strip().splitlines()[-1])


def check_export(tmp_path, monkeypatch, run_dir, live: HFGenerator) -> dict:
    trained = greedy(live)
    base = from_folder_of(tiny.build_model(), tiny.build_tokenizer())
    assert trained != base, "training did not change the greedy outputs: the test could not tell them apart"
    out = tmp_path / "exported"
    res = CliRunner().invoke(main, ["export", str(run_dir), "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert list(out.glob("*.safetensors")) and not list(out.glob("adapter_*"))
    assert from_folder(out) == trained
    texts, report = eval_texts(monkeypatch, str(out), "--plugin", "letters")
    assert texts == trained
    want = sum(bool(t) and set(t) <= TARGET for t in trained) / len(trained)  # the letters verifier's pass rule
    assert report["pass_at"]["1"] == pytest.approx(want)
    texts_run, report_run = eval_texts(monkeypatch, str(run_dir))  # the run directory; its plugin by default
    assert texts_run == trained and report_run == report
    return json.loads((out / "vrl_export.json").read_text())


def from_folder_of(model, tokenizer) -> list[str]:
    tokenizer.padding_side = "left"
    return greedy(HFGenerator(model.eval(), tokenizer, GREEDY))


@pytest.mark.slow  # subprocesses / training runs: tens of seconds on a loaded 2-core machine
@pytest.mark.parametrize("snapshot_every", [0, 2])
def test_es_export_reproduces_the_trained_model(tmp_path, monkeypatch, snapshot_every):
    run_dir, live = train(tmp_path, monkeypatch, "es", es={"snapshot_every": snapshot_every})
    info = check_export(tmp_path, monkeypatch, run_dir, live)
    assert info["optimizer"] == "es" and info["iteration"] == 3
    assert info["replayed_from"] == (2 if snapshot_every else 0)  # the snapshot at 2, then one replayed iteration


@pytest.mark.slow  # subprocesses / training runs: tens of seconds on a loaded 2-core machine
@pytest.mark.parametrize(("lora", "save_last"), [(False, "auto"), (True, "auto"), (False, "policy")])
def test_grpo_export_reproduces_the_trained_model(tmp_path, monkeypatch, lora, save_last):
    """save_last=policy: the last iteration (3) writes grpo/policy-000003 alone, which export reads."""
    grpo = {"num_generations": 4, "save_every": 2, "save_last": save_last}
    if lora:
        grpo.update(use_peft=True, lora_r=4, lora_dropout=0.0, learning_rate=5e-2)
    run_dir, live = train(tmp_path, monkeypatch, "grpo", grpo=grpo)
    info = check_export(tmp_path, monkeypatch, run_dir, live)
    assert info["optimizer"] == "grpo" and info["iteration"] == 3 and info["lora"] is lora


def cli(tmp_path, *args):
    env = {**os.environ, "COLUMNS": "250", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vrl.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def one_line_error(res, *words):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for word in words:
        assert word in lines[0], res.stderr


def test_export_refuses_with_one_line(tmp_path):
    cfg = build({"plugin": "letters", "logging": {"runs_dir": str(tmp_path / "runs"), "name": "fresh"}})
    fresh = RunDir.create(cfg).path  # a run directory with no finished iteration
    one_line_error(cli(tmp_path, "export", str(fresh), "--out", "m"), "no finished iteration")
    one_line_error(cli(tmp_path, "export", str(tmp_path / "nope"), "--out", "m"), "not a vrl run directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    one_line_error(cli(tmp_path, "export", str(fresh), "--out", "full"), "already exists and is not empty")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "m").exists()
