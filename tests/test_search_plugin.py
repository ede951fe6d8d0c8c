"""examples/search_plugin, a plugin that adds an update rule (random search) and a generator backend
(canned completions): installed like any plugin, both train through `vrl train`.

The package is pip-installed once into a folder. One check runs the real `vrl` in a child process that
sees the folder through PYTHONPATH, as a user's shell would; the others run the same `vrl` command
in-process through click's runner with the folder on `sys.path`. That is faithful: entry points are
found by scanning `sys.path` in either case, the registry is reloaded before each command as a fresh
process loads it, and what those tests check (registered names, run directories, exit status 2 with one
line) does not depend on a process of their own. In-process they skip a torch + transformers start-up
per command (about 5 CPU-seconds each)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.examples import install_example
from vrl.cli import main
from vrl.plugins import registry

LETTERS = ["--plugin", "letters", "--set", "tasks_per_iteration=4", "--set", "random_search.population_size=6"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed into a folder; the environment of a child process that sees it. The folder is
    on this process's `sys.path` while the module runs (the in-process commands find its entry point)."""
    site = tmp_path_factory.mktemp("site")
    env = install_example("search_plugin", site)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(site))
        yield env


def vrl(*args: str, env: dict[str, str] | None = None) -> Result:
    """`vrl ARGS` in this process, with the plugins loaded afresh (as a new process would load them)."""
    registry.cache_clear()
    try:
        return CliRunner().invoke(main, list(args), env=env)
    finally:
        registry.cache_clear()


def ok(res: Result) -> Result:
    assert res.exit_code == 0, res.output
    return res


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_plugin_registers_an_optimizer_and_a_backend(installed):
    """Through the real `vrl` process (the install as a user's shell sees it), then in-process."""
    out = subprocess.run([sys.executable, "-m", "vrl.cli", "plugins", "--json"], env=installed, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    search = plugins["search"]
    assert (search["distribution"], search["error"]) == ("vrl-search", None)
    assert search["registered"]["optimizers"] == ["random_search"]
    assert search["registered"]["generators"] == ["canned"]
    out = ok(vrl("config", "--optimizer", "random_search", "--set", "generator.backend=canned"))
    assert "random_search:\n  population_size: 8\n" in out.stdout and "  canned:\n    completions:\n" in out.stdout


@pytest.mark.slow
def test_random_search_trains_the_canned_backend_and_resumes_exactly(installed, tmp_path):
    """Random search on the canned policy learns letters' best answer; a run stopped after 3 iterations
    and resumed to 6 writes what an uninterrupted run writes (the accepted seeds are replayed)."""
    common = [*LETTERS, "--optimizer", "random_search", "--set", "generator.backend=canned",
              "--set", f"logging.runs_dir={tmp_path}"]
    ok(vrl("train", *common, "--iterations", "6", "--name", "whole"))
    whole = rewards(tmp_path / "whole")
    assert whole[-1] > whole[0] + 0.3 and whole[-1] > 0.8  # it learned which completion letters rewards
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["generator"]["backend"] == "canned" and config["random_search"]["population_size"] == 6
    ok(vrl("train", *common, "--iterations", "3", "--name", "part"))
    ok(vrl("train", "--resume", str(tmp_path / "part"), "--iterations", "6"))
    assert rewards(tmp_path / "part") == whole


@pytest.mark.slow
def test_each_trains_with_vrls_own_kinds(installed, tmp_path):
    """Random search moves the tiny model's weights (hf backend); ES moves the canned backend's logits."""
    ok(vrl("train", *LETTERS, "--optimizer", "random_search", "--iterations", "1", "--name", "hf",
           "--set", "random_search.population_size=2", "--set", f"logging.runs_dir={tmp_path}"))
    row = json.loads((tmp_path / "hf" / "metrics.jsonl").read_text())
    assert row["completions"] == 4 * 3 and "random_search/accepted" in row
    ok(vrl("train", "--plugin", "letters", "--set", "generator.backend=canned", "--iterations", "2",
           "--name", "es", "--set", 'es.include=["*"]', "--set", f"logging.runs_dir={tmp_path}"))
    assert len(rewards(tmp_path / "es")) == 2


@pytest.mark.slow
def test_vrl_plugins_selects_the_plugins_a_run_may_use(installed, tmp_path):
    """Hermetic runs: VRL_PLUGINS= (empty) loads vrl's built-ins alone, so the plugin's names are unknown."""
    out = vrl("train", "--optimizer", "random_search", "--set", f"logging.runs_dir={tmp_path}", env={"VRL_PLUGINS": ""})
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.exit_code == 2 and lines == [
        "error: invalid configuration: optimizer: unknown optimizer 'random_search'; installed: es, grpo "
        "(`vrl plugins` lists them)"], out.output
    listed = {p["name"]: p["error"] for p in json.loads(ok(vrl("plugins", "--json", env={"VRL_PLUGINS": "search"})).stdout)}
    assert listed == {"builtin": None, "search": None}  # loaded, not merely named
