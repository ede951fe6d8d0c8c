"""examples/custom_plugin is a real, pip-installable plugin: install it and train on it."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tests.examples import install_example
from vrl.cli import main
from vrl.plugins import registry


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed into a folder; the environment of a `vrl` process that sees it. The folder is on
    this process's `sys.path` while the module runs, for the training run made in-process."""
    site = tmp_path_factory.mktemp("site")
    env = install_example("custom_plugin", site)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(site))
        yield env


def vrl(env, *args, input=None):
    return subprocess.run([sys.executable, "-m", "vrl.cli", *args], env=env, capture_output=True, text=True, input=input)


def test_example_plugin_is_listed(installed):
    out = vrl(installed, "plugins", "--json")
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    assert plugins["reverse"]["distribution"] == "vrl-reverse"
    assert plugins["reverse"]["registered"]["environments"] == ["reverse"]
    assert plugins["reverse"]["error"] is None


@pytest.mark.slow
def test_train_one_iteration_on_the_example_plugin(installed, tmp_path):
    """`vrl train` in-process (click's runner, the plugins loaded afresh from `sys.path`, as a new process loads
    them): what it checks is the run directory, which does not depend on a process of its own; the other
    tests here run the real `vrl` process. In-process it skips a torch + transformers start-up."""
    registry.cache_clear()
    out = CliRunner().invoke(main, ["train", "--plugin", "reverse", "--iterations", "1", "--name", "rev",
                                    "--set", f"logging.runs_dir={tmp_path}", "--set", "tasks_per_iteration=2",
                                    "--set", "es.population_size=2"])
    assert out.exit_code == 0, out.output
    row = json.loads((tmp_path / "rev" / "metrics.jsonl").read_text())
    assert row["completions"] == 4 and row["status/rejected"] + row["status/failed"] + row["status/passed"] == 4
    config = json.loads((tmp_path / "rev" / "config.json").read_text())
    assert config["sampling"]["max_new_tokens"] == 24  # the plugin's declared default was applied


def test_verify_with_the_example_plugin(installed):
    lines = "\n".join([
        json.dumps({"task": {"word": "abc"}, "completion": "<answer>cba</answer>"}),
        json.dumps({"task": {"word": "abcd"}, "completion": "<answer>dcxx</answer>"}),
    ])
    out = vrl(installed, "verify", "--plugin", "reverse", "-", input=lines)
    verdicts = [json.loads(line) for line in out.stdout.splitlines()]
    assert [v["passed"] for v in verdicts] == [True, False]
    assert verdicts[1]["score"] == 0.5


def test_example_plugin_options_are_validated_up_front(installed, tmp_path):
    out = vrl(installed, "train", "--plugin", "reverse", "-o", "sise=3", "--set", f"logging.runs_dir={tmp_path}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in out.stderr.splitlines() if line.strip()] == [
        "error: environment 'reverse': unknown option 'sise'; reverse accepts size (int >= 1, default 100), "
        "seed (int, default 0)"
    ]
    assert list(tmp_path.iterdir()) == []
