"""Every axis is a registry filled through the hooks of `vrl.hookspecs`: vrl's built-ins and a
plugin's own optimizer, backend, runtime and commands, registered and checked the same way."""

import json
import os
import subprocess
import sys
import types

import click
import pytest
from click.testing import CliRunner

import vrl
from tests.test_plugins import make_dist
from vrl.config import Section, build_config_model, config_model
from vrl.plugins import PLUGINS_ENV, Registry, UnknownNameError
from vrl.runtime.local import LocalRuntime


def plugin(**hooks) -> types.SimpleNamespace:
    """A plugin object with the given hookimpls (what an entry point's module is to pluggy)."""
    return types.SimpleNamespace(**{name: vrl.hookimpl(fn) for name, fn in hooks.items()})


class ToyOptions(Section):
    """A toy section."""

    steps: int = 3


class ToyOptimizer(vrl.Optimizer):
    name = "toy"
    Config = ToyOptions


class ToyGenerator(vrl.Generator):
    name = "toy"
    Config = ToyOptions

    def stream(self, tasks, n=1, variant=0, seed=None):
        yield []


class ToyRuntime(LocalRuntime):
    name = "toy"
    Config = ToyOptions


def toy_plugin():
    return plugin(
        register_optimizers=lambda register: register("toy", ToyOptimizer),
        register_generators=lambda register: register("toy", ToyGenerator),
        register_runtimes=lambda register: register("toy", ToyRuntime),
    )


def test_the_builtins_register_through_the_hooks():
    reg = Registry().load(entry_points=False)
    assert reg.plugins["builtin"].registered == {
        "environments": ["countdown", "dataset", "guess", "letters", "sums"], "optimizers": ["es", "grpo"], "generators": ["hf", "vllm"],
        "runtimes": ["local", "modal"], "commands": []}  # commands are collected by the `vrl` group
    group = click.Group()
    reg.add_commands(group)
    assert sorted(group.commands) == ["config", "eval", "export", "modal", "plugins", "report", "train", "verify"]
    assert reg.plugins["builtin"].registered["commands"] == list(group.commands)


def test_a_plugin_adds_an_optimizer_a_backend_and_a_runtime_with_their_sections():
    reg = Registry().load(entry_points=False, plugins={"toys": toy_plugin()})
    assert reg.names("optimizers") == ["es", "grpo", "toy"]
    assert reg.factory("runtimes", "toys:toy") is ToyRuntime  # plugin:name reaches it too
    model = config_model(reg)
    cfg = model.model_validate({"optimizer": "toy", "toy": {"steps": 5}, "generator": {"backend": "toy", "toy": {"steps": 6}},
                                "runtime": {"kind": "toy", "toy": {"steps": 7}}})
    assert (cfg.toy.steps, cfg.generator.toy.steps, cfg.runtime.toy.steps) == (5, 6, 7)
    assert cfg.runtime.modal.gpu == "H100"  # every registered kind keeps its section
    with pytest.raises(Exception, match="unknown optimizer 'sgd'; installed: es, grpo, toy"):
        model.model_validate({"optimizer": "sgd"})
    # vrl's own config model knows nothing of them
    with pytest.raises(Exception, match="unknown optimizer 'toy'; installed: es, grpo"):
        config_model(Registry().load(entry_points=False)).model_validate({"optimizer": "toy"})


def test_lookups_of_unknown_names_list_what_is_registered():
    from vrl.generate import generator_class
    from vrl.optim import optimizer_class
    from vrl.runtime import runtime_class

    with pytest.raises(UnknownNameError, match=r"^unknown optimizer 'sgd'; installed: es, grpo"):
        optimizer_class("sgd")
    with pytest.raises(UnknownNameError, match=r"^unknown generator backend 'sglang'; installed: hf, vllm"):
        generator_class("sglang")
    with pytest.raises(UnknownNameError, match=r"^unknown runtime 'ray'; installed: local, modal"):
        runtime_class("ray")


def test_a_misspelt_hook_is_an_error_naming_the_plugin_and_the_hook():
    """pluggy's check_pending at load: the plugin is reported and skipped, the rest loads."""
    typo = plugin(register_optimisers=lambda register: register("toy", ToyOptimizer),
                  register_environments=lambda register: register("never", lambda: None))
    old = plugin(register_shapers=lambda register: None)
    reg = Registry().load(entry_points=False, plugins={"typo": typo, "old": old, "toys": toy_plugin()})
    assert reg.plugins["typo"].error.startswith(
        "PluginHookError: plugin 'typo' implements unknown hook 'register_optimisers'; did you mean "
        "'register_optimizers'? vrl's hooks: register_environments, register_optimizers, register_generators, "
        "register_runtimes, register_commands")
    assert "register_shapers, which vrl no longer has: an Environment returns its reward shaper" in reg.plugins["old"].error
    assert "never" not in reg.names("environments")  # none of the plugin's hooks run
    assert reg.names("optimizers") == ["es", "grpo", "toy"]


def test_bad_registrations_are_reported_and_skipped():
    bad = plugin(register_optimizers=lambda register: register("broken", object()))
    shadow = plugin(register_optimizers=lambda register: register("seed", ToyOptimizer),
                    register_generators=lambda register: register("device", ToyGenerator))
    reg = Registry().load(entry_points=False, plugins={"bad": bad, "shadow": shadow})
    assert "register a class whose `Config` is a pydantic model" in reg.plugins["bad"].error
    model = config_model(reg)  # a section may not shadow a field: left out, with a warning
    generator = model.model_fields["generator"].annotation
    assert model.model_fields["seed"].annotation is int and model.optimizers == ("es", "grpo")
    assert generator.backends == ("hf", "vllm")
    assert any("optimizer 'seed' cannot be configured: seed is already a field" in c for c in reg.conflicts)
    assert any("generator 'device' cannot be configured: generator.device is already a field" in c for c in reg.conflicts)


def test_build_config_model_gives_each_kind_its_own_section_class():
    reg = Registry().load(entry_points=False)
    model = build_config_model(reg)
    runtime = model.model_fields["runtime"].annotation
    generator = model.model_fields["generator"].annotation
    assert runtime.kinds == ("local", "modal") and generator.backends == ("hf", "vllm") and model.optimizers == ("es", "grpo")
    assert runtime.model_fields["modal"].annotation.__name__ == "ModalConfig"
    assert generator.model_fields["vllm"].annotation.__name__ == "VLLMConfig"


def test_vrl_plugins_limits_the_entry_points_that_load(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "")
    assert list(Registry().load().plugins) == ["builtin"]
    monkeypatch.setenv(PLUGINS_ENV, " lean , nope")
    reg = Registry().load()
    assert sorted(reg.plugins) == ["builtin", "lean", "nope"]
    assert reg.plugins["nope"].error.startswith("VRL_PLUGINS names 'nope', which is not installed (installed: ")
    assert reg.names("environments") == ["countdown", "dataset", "guess", "lean", "letters", "sums"]
    monkeypatch.delenv(PLUGINS_ENV)
    assert {"builtin", "lean", "python-tests"} <= set(Registry().load().plugins)


def test_plugin_commands_join_the_group_and_never_replace_one():
    @click.command()
    def hello():
        """Say hello."""
        click.echo("hello")

    def adds(cli):
        cli.add_command(hello)

        @cli.command(name="train")
        def not_train():
            """Would replace vrl train."""

    def raises(cli):
        cli.add_command(click.Command("half"))
        raise RuntimeError("no database")

    reg = Registry().load(entry_points=False, plugins={"greet": plugin(register_commands=adds),
                                                       "broken": plugin(register_commands=raises)})
    group = click.Group()
    reg.add_commands(group)
    assert group.commands["hello"] is hello and group.commands["train"].help.startswith("Train a model")
    assert "half" not in group.commands  # a hook that raises adds nothing
    assert reg.plugins["greet"].registered["commands"] == ["hello"]
    assert "command 'train' of plugin 'greet' is already taken; kept the first" in reg.conflicts
    assert "register_commands raised RuntimeError: no database" in reg.plugins["broken"].error


def test_train_and_config_share_their_options():
    from vrl.cli import config, train

    def options(command):
        return {p.name: (p.opts, p.help) for p in command.params}

    shared = options(train)
    del shared["resume"]
    mine = options(config)
    del mine["fields"]
    assert shared == mine and len(shared) == 11  # with --seed


PLUGIN = """
    import click
    import vrl

    @vrl.hookimpl
    def register_commands(cli):
        @cli.command()
        @click.argument("name")
        def hello(name):
            "Greet NAME."
            click.echo(f"hello {name}")
"""

TYPO = """
    import vrl

    @vrl.hookimpl
    def register_environment(register):
        pass
"""


def test_the_cli_runs_a_plugin_command_and_survives_a_misspelt_plugin(tmp_path):
    make_dist(tmp_path, "vrl-hello", "vrl_hello_plugin", PLUGIN, ep_name="hello")
    make_dist(tmp_path, "vrl-typo", "vrl_typo_plugin", TYPO, ep_name="typo")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def vrl_cli(*args, **extra):
        return subprocess.run([sys.executable, "-m", "vrl.cli", *args], env={**env, **extra}, capture_output=True, text=True)

    out = vrl_cli("hello", "world")
    assert out.returncode == 0 and out.stdout == "hello world\n", out.stderr
    assert "hello" in vrl_cli("--help").stdout
    listed = {p["name"]: p for p in json.loads(vrl_cli("plugins", "--json").stdout)}
    assert listed["hello"]["registered"]["commands"] == ["hello"]
    assert "unknown hook 'register_environment'; did you mean 'register_environments'?" in listed["typo"]["error"]
    hermetic = vrl_cli("hello", "world", **{PLUGINS_ENV: "typo"})
    assert hermetic.returncode == 2 and "No such command 'hello'" in hermetic.stderr


def test_unknown_kinds_are_one_line_errors_on_the_command_line(tmp_path, monkeypatch):
    from vrl.cli import main

    monkeypatch.chdir(tmp_path)
    for args, expected in [
        (["--optimizer", "sgd"], "optimizer: unknown optimizer 'sgd'; installed: es, grpo"),
        (["--runtime", "ray"], "runtime.kind: unknown runtime 'ray'; installed: local, modal"),
        (["--set", "generator.backend=sglang"], "generator.backend: unknown generator backend 'sglang'; installed: hf, vllm"),
    ]:
        res = CliRunner().invoke(main, ["train", *args])
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and expected in lines[0], res.output
    assert not (tmp_path / "runs").exists()


def test_an_environment_declares_its_modal_sandbox():
    """The Modal sandbox extension is a documented Environment method; the default is None (the plain sandbox)."""
    from vrl.envs.letters import LettersEnvironment
    from vrl.runtime.modal.sandbox import spec_for

    assert vrl.Environment.modal_sandbox.__doc__ and LettersEnvironment().modal_sandbox() is None
    spec = spec_for(LettersEnvironment(), "letters", {"size": 3})
    assert (spec.plugin, spec.options, spec.image, spec.network) == ("letters", {"size": 3}, None, False)


def _doc_plugins() -> dict[str, types.ModuleType]:
    """The complete plugin modules of docs/plugins.md (blocks starting `# plugin module: NAME`)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    modules = {}
    for name, source in re.findall(r"```python\n# plugin module: (\w+)\n(.*?)```", text, flags=re.S):
        module = types.ModuleType(f"docs_plugin_{name}")
        exec(compile(source, f"docs/plugins.md:{name}", "exec"), module.__dict__)
        modules[name] = module
    return modules


def test_the_plugin_docs_examples_work(tmp_path, monkeypatch):
    """docs/plugins.md's runtime and command examples, loaded as plugins: the runtime trains, the command runs."""
    from rich.console import Console

    from vrl.config import nest
    from vrl.envs.letters import LettersEnvironment
    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    modules = _doc_plugins()
    assert sorted(modules) == ["capped", "hello"]
    reg = Registry().load(entry_points=False, plugins=modules)
    monkeypatch.setattr("vrl.plugins.registry", lambda: reg)  # what an installed plugin is to this process
    group = click.Group()
    reg.add_commands(group)
    assert CliRunner().invoke(group, ["hello", "world"]).output == "hello world\n"
    cfg = config_model(reg).model_validate(nest({
        "plugin": "letters", "iterations": 1, "tasks_per_iteration": 2, "es.population_size": 2,
        "sampling.max_new_tokens": 4, "runtime.kind": "capped", "runtime.capped.calls": 2,
        "logging.runs_dir": str(tmp_path), "logging.name": "capped"}))
    runtime = make_runtime(cfg)
    pool = runtime.verification(LettersEnvironment().verifier(), cfg)
    assert type(runtime).__name__ == "CappedRuntime" and pool._concurrency == 2
    pool.close()
    with open(os.devnull, "w") as quiet:
        Trainer(cfg, environment=LettersEnvironment(), console=Console(file=quiet)).run()
    assert (tmp_path / "capped" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_name_registered_with_the_wrong_kind_of_class_is_one_typed_error(monkeypatch):
    """Each axis checks what a plugin registered under its name (one helper, `Registry.subclass`)."""
    from vrl.generate import generator_class
    from vrl.optim import optimizer_class
    from vrl.plugins import Registry
    from vrl.runtime import runtime_class

    monkeypatch.setattr(Registry, "factory", lambda self, kind, name: dict)
    for lookup, what, base in ((optimizer_class, "optimizer", "Optimizer"), (runtime_class, "runtime", "Runtime"),
                               (generator_class, "generator backend", "Generator")):
        with pytest.raises(TypeError, match=rf"^{what} 'x' is registered as dict, which is not a vrl\.{base}$"):
            lookup("x")
