"""TrainConfig: layered loading and errors that name the field and what is allowed."""

import json

import pytest

from vrl.config import ConfigError, build, load_file, parse_override


def test_defaults_are_the_embedded_quick_start():
    cfg = build()
    assert (cfg.plugin, cfg.model, cfg.optimizer, cfg.runtime.kind, cfg.generator.backend) == (
        "countdown", "tiny", "es", "local", "hf")


def test_layers_override_in_order(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optimizer: grpo\nsampling:\n  temperature: 0.5\n  max_new_tokens: 99\n")
    cfg = build({"sampling": {"temperature": 0.9, "top_p": 0.8}}, load_file(f), parse_override("sampling.temperature=0.7"))
    assert cfg.optimizer == "grpo"
    assert cfg.sampling.temperature == 0.7  # override beats file beats earlier layer
    assert cfg.sampling.max_new_tokens == 99
    assert cfg.sampling.top_p == 0.8


def test_toml_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('model = "tiny"\niterations = 3\n[es]\nsigma = 0.01\n')
    cfg = build(load_file(f))
    assert cfg.iterations == 3 and cfg.es.sigma == 0.01


def test_override_values_are_typed():
    assert parse_override('sampling.stop=["\\n", "</answer>"]') == {"sampling": {"stop": ["\n", "</answer>"]}}
    assert parse_override("iterations=5") == {"iterations": 5}
    assert parse_override("logging.name=my run") == {"logging": {"name": "my run"}}


@pytest.mark.parametrize(
    "layer, expected",
    [
        ({"optimizer": "ppo"}, ["optimizer: unknown optimizer 'ppo'; installed: es, grpo"]),
        ({"sampling": {"temperature": -1}}, ["sampling.temperature:", "greater than or equal to 0", "-1"]),
        ({"sampling": {"temprature": 1}}, ["sampling.temprature: unknown field; did you mean sampling.temperature?",
                                           "known fields:"]),
        # TRL's names for vrl's fields (docs/grpo.md's table) name the field meant, wherever it lives
        ({"grpo": {"save_total_limit": 2}}, ["grpo.save_total_limit: unknown field; did you mean grpo.keep_checkpoints?"]),
        ({"grpo": {"max_completion_length": 9}}, ["did you mean sampling.max_new_tokens?"]),
        ({"grpo": {"xyzzy": 1}}, ["grpo.xyzzy: unknown field; known fields: adam_beta1"]),  # nothing close: no guess
        ({"iterations": "many"}, ["iterations:", "valid integer", "'many'"]),
        ({"generator": {"dtype": "fp8"}}, ["generator.dtype:", "'auto', 'float32', 'bfloat16' or 'float16'"]),
        ({"runtime": {"kind": "cluster"}}, ["runtime.kind: unknown runtime 'cluster'; installed: local, modal"]),
        ({"generator": {"backend": "sglang"}}, ["generator.backend: unknown generator backend 'sglang'; installed: hf, vllm"]),
    ],
)
def test_validation_errors_name_field_and_allowed_values(layer, expected):
    with pytest.raises(ConfigError) as err:
        build(layer)
    for text in expected:
        assert text in str(err.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_file(tmp_path / "missing.yaml")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml or \.toml"):
        load_file(tmp_path / "x.json")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_file(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_file(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("temperature")


def test_a_dumped_config_loads_again():
    """Run directories store the resolved config; resume rebuilds it from that dump."""
    from vrl.config import dump

    for layer in ({}, {"optimizer": "grpo"}, {"sampling": {"stop": ["\n"]}, "logging": {"name": "x"}}):
        cfg = build(layer)
        assert build(dump(cfg)) == cfg


# -- sections nested by kind (issue 28) ------------------------------------------------------------------


def test_backend_and_runtime_settings_live_in_their_own_sections():
    from vrl.config import build

    cfg = build({"generator": {"backend": "vllm", "vllm": {"sleep": True, "sync_every": 2}},
                 "runtime": {"kind": "local", "local": {"engines": 2}, "modal": {"gpu": "L40S"}}})
    assert (cfg.generator.vllm.sleep, cfg.generator.vllm.sync_every, cfg.generator.hf.threads) == (True, 2, None)
    assert (cfg.runtime.local.engines, cfg.runtime.modal.gpu) == (2, "L40S")
    with pytest.raises(ConfigError, match=r"generator.vllm.sync_every > 1 .* keep generator.vllm.sampling_logprobs=true"):
        build({"generator": {"vllm": {"sync_every": 2, "sampling_logprobs": False}}})
    with pytest.raises(ConfigError, match=r"runtime.modal.gpux: unknown field; did you mean runtime.modal.gpu\? known"):
        build({"runtime": {"modal": {"gpux": "A100"}}})


@pytest.mark.parametrize("old, new", [("runtime.gpu", "runtime.modal.gpu"), ("generator.sleep", "generator.vllm.sleep"),
                                      ("generator.threads", "generator.hf.threads"),
                                      ("generator.engines", "runtime.local.engines")])
def test_a_moved_key_is_a_one_line_error_naming_its_new_key(old, new, tmp_path):
    from click.testing import CliRunner

    from vrl.cli import main
    from vrl.config import MOVED, nest

    assert MOVED[old] == new
    with pytest.raises(ConfigError, match=rf"^invalid configuration: {old}: moved to {new}$"):
        build(nest({old: 1}))
    section, key = old.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {key}: 1\n")
    (tmp_path / "old.toml").write_text(f"[{section}]\n{key} = 1\n")
    for args in (["--set", f"{old}=1"], ["--config", str(tmp_path / "old.yaml")], ["--config", str(tmp_path / "old.toml")]):
        for command in ("config", "train"):
            res = CliRunner().invoke(main, [command, *args])
            lines = [line for line in res.stderr.splitlines() if line.strip()]
            assert res.exit_code == 2 and lines == [f"error: invalid configuration: {old}: moved to {new}"], res.output


def flat(data: dict) -> dict:
    """`data` (a dumped config) with every moved key put back where it was before issue 28."""
    from vrl.config import MOVED, _get, _pop, merge, nest

    out = json.loads(json.dumps(data))
    for old, new in MOVED.items():
        value = _get(out, new)
        _pop(out, new)
        out = merge(out, nest({old: value}))
    for section, kinds in (("generator", ("hf", "vllm")), ("runtime", ("local", "modal"))):
        for kind in kinds:
            assert set(out[section].pop(kind)) <= SINCE_ISSUE_28  # which an old run never recorded
    return out


# Settings added after the flat keys moved (issue 25: Modal at scale; issue 29: vLLM weight transfer; issue 40:
# Modal output): no
# old run directory has them.
SINCE_ISSUE_28 = {"members_per_call", "min_containers", "orchestrator_timeout_s", "sandbox_idle_timeout_s",
                  "snapshot_every", "weight_transfer", "output",  # output: issue 40
                  "driver_processes",  # issue 44
                  "turn_cache",  # issue 56: generator.hf.turn_cache
                  "model_folder",  # issue 57: runtime.modal.model_folder (a local model on the Volume)
                  "kv_cache_memory_gb"}  # issue 57: generator.vllm.kv_cache_memory_gb (engines started side by side)


def test_migrate_puts_old_keys_where_they_are_now():
    from vrl.config import build, dump, migrate

    cfg = build({"generator": {"vllm": {"max_model_len": 512}}, "runtime": {"local": {"gpus": [0, 1]},
                                                                            "modal": {"secrets": ["hf"]}}})
    old = flat(dump(cfg))
    assert old["generator"]["max_model_len"] == 512 and old["generator"]["gpus"] == [0, 1]
    assert old["runtime"]["secrets"] == ["hf"] and "modal" not in old["runtime"]
    assert build(migrate(old)) == cfg
    assert migrate(dump(cfg)) == dump(cfg)  # a current config is left as it is


def test_an_old_run_directory_resumes(tmp_path):
    """A run recorded with flat keys (before issue 28) continues with `vrl train --resume`."""
    from click.testing import CliRunner

    from vrl.cli import main

    args = ["train", "--plugin", "letters", "--name", "old", "--set", f"logging.runs_dir={tmp_path}",
            "--set", "tasks_per_iteration=2", "--set", "es.population_size=2", "--set", "sampling.max_new_tokens=4"]
    res = CliRunner().invoke(main, [*args, "--iterations", "1"])
    assert res.exit_code == 0, res.output
    run = tmp_path / "old"
    recorded = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(flat(recorded)))
    res = CliRunner().invoke(main, ["train", "--resume", str(run), "--iterations", "2"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_the_field_docs_are_grouped_by_section():
    from vrl.config import builtin_config_model, field_table

    text = field_table(builtin_config_model())
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == ["### The run", "### `sampling`", "### `generator`", "### `generator.hf`", "### `generator.vllm`",
                        "### `verifier`", "### `runtime`", "### `runtime.local`", "### `runtime.modal`", "### `logging`",
                        "### `curriculum`", "### `es`", "### `grpo`"]
    assert "| `runtime.modal.gpu` | str or list[str] | `'H100'` |" in text
