"""vrl from Python: `TrainConfig(...)` and `vrl.resolve_config` resolve a configuration exactly as
`vrl train` does (one public function), and every mistake is a one-line `vrl.UsageError`."""

import io
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import vrl
from vrl.cli import main
from vrl.config import ConfigError, build
from vrl.plugins import UnknownNameError

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"time", "tokens_per_s"}


def _metrics(run: Path) -> list[dict]:
    """metrics.jsonl without what depends on the clock (seconds, tokens per second)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING and not k.endswith("_s")} for r in rows]


def readme_first_run() -> list[str]:
    """The arguments of the README's first run (the quick start's first `vrl train` after the install)."""
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    runs = [part.strip() for part in first.strip().split("&&") if part.strip().startswith("vrl train")]
    assert runs and runs[-1] == "vrl train", first  # the main job, on the embedded default, comes last
    return shlex.split(runs[0])[2:]


@pytest.mark.slow
def test_the_readme_first_run_learns_and_the_library_makes_the_same_run(tmp_path):
    """The README's first run (letters) visibly learns in its 10 iterations, and
    `vrl.Trainer(vrl.TrainConfig(plugin="letters", iterations=10)).run()` is the same run: the same
    resolved configuration and identical metrics (same seed). Before one resolution served both, the
    library ignored the environment's suggested settings and went 0.071 -> 0.045.
    Measured: 0.069 in the first iteration, 1.0 in the last. The library's run is stopped (as Ctrl-C
    stops it) after its third iteration: a difference between the two paths (a setting, the runtime,
    the seeding) shows from the first iteration on, and its last seven would cost ~7 CPU-seconds more."""
    args = readme_first_run()
    assert args == ["--plugin", "letters"]
    res = CliRunner().invoke(main, ["train", *args, "--iterations", "10", "--name", "cli",
                                    "--set", f"logging.runs_dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    config = vrl.TrainConfig(plugin="letters", iterations=10, logging={"runs_dir": str(tmp_path), "name": "lib"})

    def stop_after_the_third(metrics):
        if metrics["iteration"] == 2:
            raise KeyboardInterrupt

    summary = vrl.Trainer(config, console=Console(file=io.StringIO()), on_iteration=stop_after_the_third).run()
    assert summary["status"] == "interrupted" and summary["iterations_completed"] == 3, summary

    cli_config, lib_config = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("cli", "lib"))
    assert cli_config["logging"].pop("name") == "cli" and lib_config["logging"].pop("name") == "lib"
    assert cli_config == lib_config
    assert cli_config["es"]["sigma"] == 0.2 and cli_config["es"]["include"] == ["lm_head.*"]  # letters' suggestions
    cli_rows, lib_rows = _metrics(tmp_path / "cli"), _metrics(tmp_path / "lib")
    assert len(cli_rows) == 10 and len(lib_rows) == 3 and cli_rows[:3] == lib_rows
    rewards = [r["reward_mean"] for r in cli_rows]
    assert rewards[0] < 0.15 and rewards[-1] > 0.8, rewards


def test_train_config_layers_the_environments_defaults_under_the_fields_given():
    cfg = vrl.TrainConfig(plugin="letters", es={"sigma": 0.1}, sampling={"temperature": 0.5})
    assert (cfg.es.sigma, cfg.es.alpha, cfg.es.include) == (0.1, 1.0, ["lm_head.*"])  # the rest of letters' es stays
    assert (cfg.sampling.temperature, cfg.sampling.max_new_tokens) == (0.5, 16)
    assert vrl.TrainConfig(plugin="letters", es=vrl.TrainConfig().es.model_copy(update={})).es.sigma == 0.2
    assert vrl.TrainConfig().sampling.max_new_tokens == 64  # countdown's
    assert vrl.TrainConfig(plugin="letters").model_dump() == vrl.resolve_config({"plugin": "letters"}).model_dump()
    assert build({"plugin": "letters"}).es.sigma == vrl.TrainConfig().es.sigma  # build: the layers as given


def test_resolve_config_layers_file_fields_and_overrides_as_the_cli_does(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("plugin: letters\nes:\n  sigma: 0.3\n  alpha: 0.5\nseed: 4\n")
    cfg = vrl.resolve_config({"es.alpha": 0.25, "iterations": 2}, file=f, overrides=["seed=9", "es.population_size=6"])
    assert (cfg.plugin, cfg.es.sigma, cfg.es.alpha, cfg.seed, cfg.iterations) == ("letters", 0.3, 0.25, 9, 2)
    assert (cfg.es.population_size, cfg.es.include) == (6, ["lm_head.*"])
    res = CliRunner().invoke(main, ["config", "--config", str(f), "--iterations", "2", "--set", "es.alpha=0.25",
                                    "--set", "seed=9", "--set", "es.population_size=6"])
    assert res.exit_code == 0, res.output
    import yaml

    assert yaml.safe_load(res.stdout) == json.loads(json.dumps(cfg.model_dump(mode="json")))


def test_an_environment_object_brings_its_defaults_and_name():
    class Tiny(vrl.Environment):
        name = "tiny-env"
        defaults = {"sampling.max_new_tokens": 5, "es.sigma": 0.05}

        def tasks(self, split="train", limit=None):
            return []

        def verifier(self):
            raise NotImplementedError

    cfg = vrl.resolve_config({"es.sigma": 0.07}, environment=Tiny())
    assert (cfg.plugin, cfg.sampling.max_new_tokens, cfg.es.sigma) == ("tiny-env", 5, 0.07)
    assert vrl.TrainConfig(plugin="tiny-env").sampling.max_new_tokens == 64  # not registered: no suggestions known


@pytest.mark.parametrize("make, expected", [
    (lambda: vrl.TrainConfig(plugin="letters", iteratons=3), "iteratons: unknown field; did you mean iterations? known fields: "),
    (lambda: vrl.TrainConfig(sampling={"temprature": 1}), "sampling.temprature: unknown field"),
    (lambda: vrl.TrainConfig(iterations=0), "iterations: Input should be greater than or equal to 1 (got 0)"),
    (lambda: vrl.TrainConfig(runtime={"gpu": "H100"}), "runtime.gpu: moved to runtime.modal.gpu"),
    (lambda: vrl.resolve_config({"plugin": "leters"}), "unknown environment 'leters'; installed: "),
    (lambda: setattr(vrl.TrainConfig(), "iterations", -2), "iterations: Input should be greater than or equal to 1"),
    (lambda: setattr(vrl.TrainConfig().sampling, "top_p", 2), "top_p: Input should be less than or equal to 1"),
    (lambda: setattr(vrl.TrainConfig(), "iteratons", 2), "iteratons: unknown field; did you mean iterations?"),
])
def test_library_errors_are_one_line_usage_errors(make, expected):
    with pytest.raises(vrl.UsageError) as err:
        make()
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, (ConfigError, UnknownNameError))
