"""TrainConfig: layered loading and errors that name the field and what is allowed."""

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
        ({"optimizer": "ppo"}, ["optimizer:", "'es' or 'grpo'", "'ppo'"]),
        ({"sampling": {"temperature": -1}}, ["sampling.temperature:", "greater than or equal to 0", "-1"]),
        ({"sampling": {"temprature": 1}}, ["sampling.temprature: unknown field", "known fields:", "temperature"]),
        ({"iterations": "many"}, ["iterations:", "valid integer", "'many'"]),
        ({"generator": {"dtype": "fp8"}}, ["generator.dtype:", "'auto', 'float32', 'bfloat16' or 'float16'"]),
        ({"runtime": {"kind": "cluster"}}, ["runtime.kind:", "'local'"]),
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
