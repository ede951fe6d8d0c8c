"""examples/search_plugin, a plugin that adds an update rule (random search) and a generator backend
(canned completions): installed like any plugin, both train through `vrl train`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples import install_example

LETTERS = ["--plugin", "letters", "--set", "tasks_per_iteration=4", "--set", "random_search.population_size=6"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_example("search_plugin", tmp_path_factory.mktemp("site"))


def vrl(env, *args, **extra):
    return subprocess.run([sys.executable, "-m", "vrl.cli", *args], env={**env, **extra}, capture_output=True, text=True)


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_plugin_registers_an_optimizer_and_a_backend(installed):
    plugins = {p["name"]: p for p in json.loads(vrl(installed, "plugins", "--json").stdout)}
    search = plugins["search"]
    assert (search["distribution"], search["error"]) == ("vrl-search", None)
    assert search["registered"]["optimizers"] == ["random_search"]
    assert search["registered"]["generators"] == ["canned"]
    out = vrl(installed, "config", "--optimizer", "random_search", "--set", "generator.backend=canned")
    assert out.returncode == 0, out.stderr
    assert "random_search:\n  population_size: 8\n" in out.stdout and "  canned:\n    completions:\n" in out.stdout


@pytest.mark.slow
def test_random_search_trains_the_canned_backend_and_resumes_exactly(installed, tmp_path):
    """Random search on the canned policy learns letters' best answer; a run stopped after 3 iterations
    and resumed to 6 writes what an uninterrupted run writes (the accepted seeds are replayed)."""
    common = [*LETTERS, "--optimizer", "random_search", "--set", "generator.backend=canned",
              "--set", f"logging.runs_dir={tmp_path}"]
    out = vrl(installed, "train", *common, "--iterations", "6", "--name", "whole")
    assert out.returncode == 0, out.stderr
    whole = rewards(tmp_path / "whole")
    assert whole[-1] > whole[0] + 0.3 and whole[-1] > 0.8  # it learned which completion letters rewards
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["generator"]["backend"] == "canned" and config["random_search"]["population_size"] == 6
    assert vrl(installed, "train", *common, "--iterations", "3", "--name", "part").returncode == 0
    out = vrl(installed, "train", "--resume", str(tmp_path / "part"), "--iterations", "6")
    assert out.returncode == 0, out.stderr
    assert rewards(tmp_path / "part") == whole


@pytest.mark.slow
def test_each_trains_with_vrls_own_kinds(installed, tmp_path):
    """Random search moves the tiny model's weights (hf backend); ES moves the canned backend's logits."""
    out = vrl(installed, "train", *LETTERS, "--optimizer", "random_search", "--iterations", "1", "--name", "hf",
              "--set", "random_search.population_size=2", "--set", f"logging.runs_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    row = json.loads((tmp_path / "hf" / "metrics.jsonl").read_text())
    assert row["completions"] == 4 * 3 and "random_search/accepted" in row
    out = vrl(installed, "train", "--plugin", "letters", "--set", "generator.backend=canned", "--iterations", "2",
              "--name", "es", "--set", 'es.include=["*"]', "--set", f"logging.runs_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert len(rewards(tmp_path / "es")) == 2


@pytest.mark.slow
def test_vrl_plugins_selects_the_plugins_a_run_may_use(installed, tmp_path):
    """Hermetic runs: VRL_PLUGINS= (empty) loads vrl's built-ins alone, so the plugin's names are unknown."""
    out = vrl(installed, "train", "--optimizer", "random_search", "--set", f"logging.runs_dir={tmp_path}", VRL_PLUGINS="")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines == [
        "error: invalid configuration: optimizer: unknown optimizer 'random_search'; installed: es, grpo "
        "(`vrl plugins` lists them)"], out.stderr
    listed = [p["name"] for p in json.loads(vrl(installed, "plugins", "--json", VRL_PLUGINS="search").stdout)]
    assert listed == ["builtin", "search"]
