"""The plugin contract: the hooks a vrl plugin may implement.

A plugin is a module exposed through the `vrl` entry-point group::

    [project.entry-points.vrl]
    my_plugin = "my_package.plugin"

and implements any of the hooks below with ``@vrl.hookimpl``. Each hook receives a `register`
callable; registering is cheap and lazy (factories are called only when the name is used), so
`vrl plugins` never imports a plugin's heavy dependencies.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("vrl")
hookimpl = pluggy.HookimplMarker("vrl")

Register = Callable[..., None]  # register(name, factory)


@hookspec
def register_environments(register: Register) -> None:
    """Register environments by name: ``register("countdown", factory)``.

    ``factory(**options)`` returns an `vrl.Environment`; ``options`` come from the run config's
    ``env_options``. Example::

        @vrl.hookimpl
        def register_environments(register):
            register("echo", lambda **opts: EchoEnvironment(**opts))
    """


@hookspec
def register_verifiers(register: Register) -> None:
    """Register stand-alone verifiers by name: ``register("lean", factory)``.

    ``factory(**options)`` returns a `vrl.Verifier`. Environments already bring their own verifier;
    this hook is for verifiers that other environments (or users' scripts) may reuse.
    """


@hookspec
def register_shapers(register: Register) -> None:
    """Register reward shapers by name: ``register("length_penalty", factory)``.

    ``factory(**options)`` returns a `vrl.RewardShaper`.
    """

