"""Seconds of checks before minutes of generation, shared by `vrl train` (the trainer) and `vrl eval`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from vrl.optim import optimizer_class
from vrl.runtime import runtime_class
from vrl.verifier import ensure_ready

if TYPE_CHECKING:
    from vrl.config import TrainConfig
    from vrl.environment import Environment


def verifies_in_process(config: TrainConfig) -> bool:
    """Whether the verifier runs in this process (not in Modal sandboxes, which start their own server)."""
    return runtime_class(config.runtime.kind).verifies_in_process(config)


def check_episodes(config: TrainConfig, env: Environment, runtime: type) -> None:
    """A multi-turn environment needs a runtime and a generator backend that run episodes: refused in one
    line before anything starts, naming the setting to change."""
    from vrl.errors import UsageError
    from vrl.generate import generator_class

    if not runtime.runs_episodes:
        raise UsageError(f"environment {env.name!r} runs multi-turn episodes, which runtime {config.runtime.kind!r} "
                         "does not support yet; run it with --set runtime.kind=local")
    if not generator_class(config.generator.backend).runs_episodes:
        raise UsageError(f"environment {env.name!r} runs multi-turn episodes, which generator backend "
                         f"{config.generator.backend!r} does not support yet; use --set generator.backend=hf")
    if (elsewhere := runtime.episodes_elsewhere(config)) is not None:
        from vrl.plugins import environment_wire

        environment_wire(env, config, *elsewhere)  # those hosts build it from the plugin: refused if made in code
    if runtime.weights_here:  # the tokenizer is where the weights are
        check_tools_render(config, env)


#: How many of the split's first tasks `check_tools_render` looks at for one whose episodes offer tools.
TOOL_PROBE_TASKS = 32


def check_tools_render(config: TrainConfig, env: Environment) -> None:
    """Episodes that offer tools need a chat template that shows them to the model: refused here, before the model
    loads, in the line the first episode would raise (`vrl.episodes.ToolsNotRendered`: use a model whose template
    renders tools, or give no tools). Looks at the first episodes' tools (`Interaction.tools`) without starting
    them (no environment class's `reset` runs); a tokenizer that does not load is left to the runtime's check."""
    from vrl.episodes import _check_renders_tools, release
    from vrl.errors import UnknownSplitError

    try:
        tasks = env.tasks(config.split, limit=TOOL_PROBE_TASKS)
    except UnknownSplitError:  # (`vrl eval` of another split) the first episode still refuses, in the same line
        return
    for task in tasks:
        interaction = env.interaction(task)
        tools = getattr(interaction, "tools", None)
        release(interaction)  # a pooled environment instance goes back unused
        if tools:
            tokenizer = _tokenizer(config)
            if tokenizer is not None:
                _check_renders_tools(tokenizer, tools)
            return


def _tokenizer(config: TrainConfig) -> Any:
    """The policy's tokenizer (`tiny`: built; a GGUF file: its converted folder's), or None when it does not load."""
    from vrl.generate.hf import TINY

    if config.model == TINY:
        from vrl.generate import tiny

        return tiny.build_tokenizer()
    from transformers import AutoTokenizer

    from vrl.gguf import is_gguf, resolve_any

    name, revision = (resolve_any(config.model), None) if is_gguf(config.model) else (config.model, config.generator.revision)
    try:
        return AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError):
        return None


def preflight(config: TrainConfig, env: Environment, *, training: bool = True) -> None:
    """Seconds of checks before minutes of generation (train and eval), after handing the environment the run's
    settings (`Environment.configure`): the runtime's own checks (the local one: the model can be loaded, the
    devices exist), the optimizer's settings fit the model (`training`), the verifier answers."""
    env.configure(config)
    runtime = runtime_class(config.runtime.kind)
    if env.multi_turn:
        check_episodes(config, env, runtime)
    runtime.check(config)  # a runtime whose weights load elsewhere carries a local model there (Modal: its Volume)
    if training:  # the weightless module tree is built only for a rule that asks for it
        # Imported here, not at the top: it loads torch, which `import vrl` must not (issue 28).
        from vrl.generate import generator_class
        from vrl.generate.hf import meta_model

        model = functools.partial(meta_model, config.model, config.generator.revision) if runtime.weights_here else None
        rule = optimizer_class(config.optimizer)
        rule.check_fits(config, model)
        generator_class(config.generator.backend).check_fits(config, rule.from_config(config).needs(), model)
    if verifies_in_process(config):
        ensure_ready(env.verifier())
