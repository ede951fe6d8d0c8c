"""The plugin contract: every hook a vrl plugin may implement, documented where it is declared.

A plugin is a module exposed through the `vrl` entry-point group::

    [project.entry-points.vrl]
    my_plugin = "my_package.plugin"

and implements any of the hooks below with ``@vrl.hookimpl``. vrl's own environments, update
rules, generator backends, runtimes and commands are registered by `vrl.builtin` through these same
hooks, so a plugin can add (or replace, under its own `plugin:name`) any of them.

The hooks, by when vrl calls them:

- **Registration** (once per process, the first time vrl needs a name of that kind; each hook gets
  a ``register(name, obj)`` callable): `register_environments`, `register_optimizers`,
  `register_generators`, `register_runtimes`.
- **Command line** (when the `vrl` command starts): `register_commands`.

No hook is ``firstresult``: every plugin's answer counts (each adds names), and a name claimed
twice keeps the first plugin's entry (`vrl plugins` shows the conflict). A hookimpl whose name is
not one of these (a typo) makes its plugin fail to load, with an error naming the plugin and the
hook (`pluggy`'s ``check_pending``); the CLI reports the plugin and goes on without it.

Register classes, and import them inside the hook's body: `vrl plugins` and `vrl --help` load
every plugin's module, and should not pay for its heavy dependencies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

# What the registration hooks receive: register(name, obj). The objects are classes of the layers above
# this module (`vrl.Optimizer`, `vrl.Generator`, `vrl.Runtime` subclasses) or environment factories;
# they are named in each hook's docstring rather than imported, so the plugin contract imports nothing
# of vrl and no import cycle runs through it.
Register = Callable[[str, Any], None]
RegisterFactory = Callable[[str, Callable[..., Any]], None]  # an environment factory (usually its class)
RegisterClass = Callable[[str, type], None]  # a subclass of the hook's base class, with its `Config`

hookspec = pluggy.HookspecMarker("vrl")
hookimpl = pluggy.HookimplMarker("vrl")


# -- registration ------------------------------------------------------------------------------------


@hookspec
def register_environments(register: RegisterFactory) -> None:
    """Register environments by name: ``register("countdown", CountdownEnvironment)``.

    The object is a factory: ``factory(**options)`` returns a `vrl.Environment`, with the run's
    ``env_options`` (``-o KEY=VALUE``) as keyword arguments. Register the class itself when it
    declares `defaults` or `Options` (the CLI reads them before building anything). Selected with
    ``vrl train --plugin NAME``. Example::

        @vrl.hookimpl
        def register_environments(register):
            from my_package.env import EchoEnvironment

            register("echo", EchoEnvironment)
    """


@hookspec
def register_optimizers(register: RegisterClass) -> None:
    """Register update rules by name: ``register("es", ES)``.

    The object is a `vrl.Optimizer` subclass. Its ``Config`` (a pydantic model) becomes the config
    section named after it (``es.*``), its ``from_config(config)`` builds it for a run. Selected with
    ``optimizer: NAME`` (``vrl train --optimizer NAME``). Example::

        @vrl.hookimpl
        def register_optimizers(register):
            from my_package.search import RandomSearch

            register("random", RandomSearch)
    """


@hookspec
def register_generators(register: RegisterClass) -> None:
    """Register generator backends by name: ``register("vllm", VLLMGenerator)``.

    The object is a `vrl.Generator` subclass. Its ``Config`` becomes the section
    ``generator.<name>.*``; ``from_config(config, needs, gpu=...)`` starts one engine for a run
    (``needs``: what the update rule will ask of it, `vrl.policy.HostNeeds`, or None for sampling
    only); ``engines(config, needs, gpus)`` starts several (the local runtime's
    ``runtime.local.engines``). Selected with ``generator.backend: NAME``. Example::

        @vrl.hookimpl
        def register_generators(register):
            from my_package.canned import CannedGenerator

            register("canned", CannedGenerator)
    """


@hookspec
def register_runtimes(register: RegisterClass) -> None:
    """Register runtimes by name: ``register("modal", ModalRuntime)``.

    The object is a `vrl.Runtime` subclass. Its ``Config`` becomes the section
    ``runtime.<name>.*``; ``from_config(config)`` builds it for a run. Selected with
    ``runtime.kind: NAME`` (``vrl train --runtime NAME``). Example::

        @vrl.hookimpl
        def register_runtimes(register):
            from my_package.ray_runtime import RayRuntime

            register("ray", RayRuntime)
    """


# -- command line ------------------------------------------------------------------------------------


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add commands to the `vrl` command line (a `click` group), as simonw/llm's plugins do.

    A command name another plugin (or vrl) already uses keeps its first owner. Example::

        @vrl.hookimpl
        def register_commands(cli):
            @cli.command()
            def hello():
                "Say hello."
                click.echo("hello")
    """
