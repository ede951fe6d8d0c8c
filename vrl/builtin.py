"""vrl's own plugin: the built-in environments, update rules, generator backends, runtimes and
commands, registered through the same hooks (`vrl.hookspecs`) as any third-party plugin's."""

from __future__ import annotations

from vrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    from vrl.envs.countdown import CountdownEnvironment
    from vrl.envs.dataset import DatasetEnvironment
    from vrl.envs.guess import GuessEnvironment
    from vrl.envs.letters import LettersEnvironment
    from vrl.envs.sums import SumsEnvironment

    register("countdown", CountdownEnvironment)
    register("dataset", DatasetEnvironment)
    register("guess", GuessEnvironment)
    register("letters", LettersEnvironment)
    register("sums", SumsEnvironment)


@hookimpl
def register_optimizers(register):
    from vrl.optim.es import ES
    from vrl.optim.grpo import GRPO

    register("es", ES)
    register("grpo", GRPO)


@hookimpl
def register_generators(register):
    from vrl.generate.hf import HFGenerator
    from vrl.generate.vllm import VLLMGenerator

    register("hf", HFGenerator)
    register("vllm", VLLMGenerator)


@hookimpl
def register_runtimes(register):
    from vrl.runtime.local import LocalRuntime
    from vrl.runtime.modal.runtime import ModalRuntime

    register("local", LocalRuntime)
    register("modal", ModalRuntime)


@hookimpl
def register_commands(cli):
    from vrl.cli import COMMANDS

    for command in COMMANDS:
        cli.add_command(command)
