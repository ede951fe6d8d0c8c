"""The docs stay in step with the code."""

import json
import re
from pathlib import Path

import click
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
