"""The docs stay in step with the code."""

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from vrl.cli import main
from vrl.config import builtin_config_model, field_table

ROOT = Path(__file__).resolve().parents[1]


def test_config_field_table_is_current():
    text = (ROOT / "docs" / "config.md").read_text()
    start, end = "<!-- fields:start -->\n", "<!-- fields:end -->"
    table = text[text.index(start) + len(start) : text.index(end)]
    assert table == field_table(builtin_config_model()), "refresh it with: python -m vrl.config"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_cli_md_verify_example_gives_the_output_shown():
    text = (ROOT / "docs" / "cli.md").read_text()
    attempts, shown = _blocks(text, "json")[:2]
    res = CliRunner().invoke(main, ["verify", "-"], input=attempts)
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    want = [json.loads(line) for line in shown.splitlines()]
    assert [{k: v for k, v in r.items() if k != "elapsed_s"} for r in got] == \
        [{k: v for k, v in r.items() if k != "elapsed_s"} for r in want]
    summary = re.search(r"A summary \(`(\d+/\d+ passed)`\)", text).group(1)
    assert summary in res.stderr


def test_cli_md_command_table_lists_every_command():
    text = (ROOT / "docs" / "cli.md").read_text()
    listed = set(re.findall(r"^\| `vrl ([a-z]+(?: [a-z]+)?)", text, flags=re.M))
    listed = {name.split()[0] if name.split()[0] != "modal" else name for name in listed}
    commands = set()
    for name, command in main.commands.items():
        if isinstance(command, click.Group):
            commands |= {f"{name} {sub}" for sub in command.commands}
        else:
            commands.add(name)
    assert commands == listed


def test_readme_names_the_pass_at_k_that_eval_prints():
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("vrl eval"))
    args = line.split("#")[0].split()[1:]
    res = CliRunner().invoke(main, [*args, "--limit", "1", "--json", "--set", "sampling.max_new_tokens=4"])
    assert res.exit_code == 0, res.output
    printed = list(json.loads(res.stdout)["pass_at"])
    assert re.findall(r"pass@(\d+)", line) == printed


@pytest.mark.slow
def test_python_md_examples_run(tmp_path, monkeypatch):
    """docs/python.md's examples, top to bottom in one namespace as the page says, in a fresh directory
    (they train and evaluate the tiny model for real: a few seconds each)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    blocks = _blocks((ROOT / "docs" / "python.md").read_text(), "python")
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/python.md, example {i + 1}", "exec"), namespace)
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert [name.split("-")[:2] for name in runs] == [["letters", "es"], ["letters", "es"], ["vowels", "es"]]
    assert namespace["summary"]["status"] == "finished" and set(namespace["report"]["pass_at"]) == {"1"}


def test_python_md_is_linked_from_the_readme_and_the_docs_list():
    readme = (ROOT / "README.md").read_text()
    docs = readme[readme.index("## Documentation"):]
    assert "[docs/python.md](docs/python.md)" in docs
    assert "(docs/python.md)" in readme[: readme.index("## Documentation")]  # the quick start points to it


def test_plugins_md_shows_letters_defaults_as_the_template():
    from vrl.envs.letters import LettersEnvironment

    text = (ROOT / "docs" / "plugins.md").read_text()
    block = next(b for b in _blocks(text, "python") if b.startswith("class LettersEnvironment"))
    namespace: dict = {}
    exec("import vrl\n" + block, namespace)
    assert namespace["LettersEnvironment"].defaults == LettersEnvironment.defaults


@pytest.mark.slow
def test_plugins_md_pyproject_installs_as_written(tmp_path):
    """The page's pyproject.toml, plugin module and environment, written out as the page says and
    pip-installed (into a folder: the test venv stays untouched): vrl finds the plugin and its environment."""
    import os
    import subprocess
    import sys

    text = (ROOT / "docs" / "plugins.md").read_text()
    src = tmp_path / "src"
    (src / "vrl_reverse").mkdir(parents=True)
    (src / "pyproject.toml").write_text(next(b for b in _blocks(text, "toml") if b.startswith("# pyproject.toml")))
    (src / "vrl_reverse" / "__init__.py").write_text("")
    (src / "vrl_reverse" / "plugin.py").write_text(
        next(b for b in _blocks(text, "python") if b.startswith("# vrl_reverse/plugin.py (beside")))
    env = text[text.index("## An environment in full"):]
    (src / "vrl_reverse" / "env.py").write_text(_blocks(env, "python")[0])
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--target", str(tmp_path / "site"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    environ = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "vrl.cli", "plugins", "--json"], env=environ, capture_output=True,
                         text=True)
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    assert plugins["reverse"]["distribution"] == "vrl-reverse" and plugins["reverse"]["error"] is None
    shown = subprocess.run([sys.executable, "-m", "vrl.cli", "config", "--plugin", "reverse"], env=environ,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "max_new_tokens: 24" in shown.stdout  # the environment's defaults reach the configuration


def test_multi_turn_md_examples_run_each_on_its_own(tmp_path, monkeypatch):
    """docs/multi-turn.md's examples, each alone in a fresh namespace and a fresh directory (a reader copies one):
    an environment that answers back, tools on a dataset, a TRL environment class (the tiny model, a few seconds
    each)."""
    blocks = _blocks((ROOT / "docs" / "multi-turn.md").read_text(), "python")
    assert len(blocks) == 3
    made = []
    for i, block in enumerate(blocks):
        here = tmp_path / f"example-{i + 1}"
        here.mkdir()
        monkeypatch.chdir(here)
        exec(compile(block, f"docs/multi-turn.md, example {i + 1}", "exec"), {"__name__": f"example_{i + 1}"})
        made += [p.name.split("-")[0] for p in (here / "runs").iterdir()]
    assert made == ["vowel", "dataset", "dataset"]
    readme = (ROOT / "README.md").read_text()
    assert "[docs/multi-turn.md](docs/multi-turn.md)" in readme[readme.index("## Documentation"):]


def test_a_verifier_error_is_said_to_have_no_reward_where_it_is_reported(tmp_path):
    """Issue 56, item 8: a verifier error has no reward for GRPO (NaN) or ES (left out), never 0. The console line
    of a run whose verifier raises on some attempts, and docs/plugins.md's section on it, say so; neither says they
    are "scored as crashed" (which read as reward 0)."""
    import io
    import itertools

    from rich.console import Console

    from vrl.config import build
    from vrl.envs.letters import LettersEnvironment, LettersVerifier
    from vrl.trainer import Trainer

    checks = itertools.count()

    class SometimesRaises(LettersVerifier):
        def check(self, attempt):
            if next(checks) % 4 == 0:
                raise ValueError("cannot parse this one")
            return super().check(attempt)

    class Env(LettersEnvironment):
        def verifier(self):
            return SometimesRaises()

    out = io.StringIO()
    layer = {"optimizer": "grpo", "iterations": 1, "tasks_per_iteration": 2, "sampling": {"max_new_tokens": 4},
             "grpo": {"num_generations": 4}, "logging": {"runs_dir": str(tmp_path), "name": "errors"}}
    Trainer(build(layer, {}), environment=Env(), console=Console(file=out, width=400)).run()
    [line] = [x for x in out.getvalue().splitlines() if "reported once" in x]
    assert "no reward" in line and "GRPO leaves them out" in line and "scored as crashed" not in line
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("### A broken verifier or shaper stops the run"):text.index("## Options")]
    assert "no reward, never\n0" in section and "NaN" in section and "scored as crashed" not in section
