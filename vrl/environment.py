"""The Environment: what a plugin registers to make `vrl train --plugin NAME` work.

An environment owns a task source (with splits), prompt formatting (tasks carry their prompts),
its verifier, its reward shaper, and defaults for the run (model, sampling, optimizer settings).
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import shlex
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo

from vrl.errors import OptionsError, UnknownSplitError
from vrl.reward import Binary, RewardShaper
from vrl.types import Task
from vrl.verifier import Verifier

if TYPE_CHECKING:  # types only
    from vrl.episodes import Interaction


@dataclass(frozen=True)
class SandboxSpec:
    """What a verifier sandbox runs: the command (verify server, maybe a sidecar) and its limits.

    An environment describes its own sandbox by overriding `Environment.modal_sandbox()` to return
    one of these, or a dict of its fields (the Lean plugin names the kimina-lean-server image and its
    start command). It lives here, in the core, because environments return it; the Modal runtime
    (`vrl.runtime.modal.sandbox`) runs it.
    """

    plugin: str
    options: dict[str, Any] = field(default_factory=dict)
    image: str | None = None  # registry image to build on; None: debian_slim
    sidecar: tuple[str, ...] = ()  # a server started in the background before the verify server
    wait_url: str | None = None  # health URL of the sidecar; the verify server answers once it is healthy
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    network: bool = False  # a verifier that must reach the network sets this (code verifiers never do)
    # Attempts (`Attempt` JSON) the verify server judges before it answers its first ping; every one must
    # pass. Ready then means ready to judge (a Lean server with Mathlib imported), not merely alive.
    warmup: tuple[dict[str, Any], ...] = ()
    # Verifier options for the warm-up only (the Lean plugin: a per-proof timeout long enough to import Mathlib
    # on every REPL at once), on top of `options`; the batches that follow use `options` alone.
    warmup_options: dict[str, Any] = field(default_factory=dict)
    memory_mb: int | None = None  # what the sidecar needs (e.g. kimina: 8 GiB per REPL); the sandbox gets at least this
    apt: tuple[str, ...] = ()  # Debian packages the verifier needs on top of `image` (Lean's re-check: bubblewrap)

    def command(self, python: str = "python", wait_timeout_s: float = 600.0) -> list[str]:
        """argv of the sandbox's main process."""
        serve = [python, "-m", "vrl.runtime.modal.verify_server", "--plugin", self.plugin]
        for key, value in self.options.items():
            serve += ["-o", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        if self.wait_url:
            serve += ["--wait-url", self.wait_url]
        if self.wait_url or self.warmup:
            serve += ["--wait-timeout", str(wait_timeout_s)]
        if self.warmup:
            serve += ["--warmup", json.dumps(list(self.warmup))]
            for key, value in self.warmup_options.items():
                serve += ["--warmup-option", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        if not self.sidecar:
            return serve
        sidecar = shlex.join(self.sidecar)
        return ["bash", "-c", f"{sidecar} >/tmp/sidecar.log 2>&1 & exec {shlex.join(serve)}"]


class EnvOptions(BaseModel):
    """Base of an environment's options (`-o KEY=VALUE`): unknown keys and wrong types are errors.

    Subclass it with one field per option (type, default, constraints, description) and set it as
    the environment's `Options`; the registry validates the user's options before building anything.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class Environment(ABC):
    """A concrete world to train in. Subclass it and register a factory from a plugin hook."""

    name: str = "environment"
    description: str = ""
    splits: tuple[str, ...] = ("train", "test")
    #: Config overrides this environment suggests, as dotted keys (`{"sampling.temperature": 0.6}`).
    #: They sit below the user's config file and command line.
    defaults: dict[str, Any] = {}
    #: The options the environment accepts (`-o KEY=VALUE`). With `Options` set, write
    #: `__init__(self, **options)` and start it with `o = self.parse_options(options)`; without, options
    #: are checked against the signature of `__init__` (see `options_model`).
    Options: ClassVar[type[EnvOptions] | None] = None

    @abstractmethod
    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        """The tasks of a split, in a stable order; at most `limit` of them."""

    @abstractmethod
    def verifier(self) -> Verifier:
        """A fresh verifier for this environment's tasks."""

    def shaper(self) -> RewardShaper:
        """How verdicts become rewards. Default: 1 for a pass, 0 otherwise."""
        return Binary()

    def interaction(self, task: Task) -> Interaction | None:
        """The environment's side of an episode on `task` (a `vrl.episodes.Interaction`, a fresh object per
        episode), so it can answer the model's turns; None (the default): one turn, judged by the verifier."""
        return None

    @property
    def multi_turn(self) -> bool:
        """Whether episodes of this environment may take more than one turn (it overrides `interaction`)."""
        return type(self).interaction is not Environment.interaction

    def configure(self, config: Any) -> None:  # a vrl.TrainConfig: not imported here (vrl.config -> plugins -> here)
        """The run's settings (`vrl.TrainConfig`), handed over by the preflight of `vrl train` and `vrl eval` before
        anything is checked or generated. Default: nothing. `dataset` hands `sampling.chat_template_kwargs` to its
        reward models (TRL renders a reward model's prompt and completion with them)."""

    def begin_iteration(self, iteration: int, iterations: int) -> None:
        """The run starts iteration `iteration` (0-based) of `iterations`, before it samples the iteration's tasks.
        Default: nothing. `dataset` hands it to its reward functions (TRL's `trainer_state`)."""

    def iteration_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The metrics.jsonl entries made from an iteration's summed `Verdict.metrics` (verifier counters).

        Default: the sums as they are. Override to add rates (the lean plugin adds `lean/exploit_rate`);
        name a derived value for what it is (`_rate`, `_ratio`, `_fraction`, `_mean`, `/mean`, `/max`, ...),
        so `vrl report` shows it as a rate rather than summing it over the run like a counter.
        """
        return dict(sums)

    def summary_notes(self) -> list[str]:
        """Lines the run's closing summary must carry about how it was judged (e.g. a check turned off).

        Default: none. Shown in the summary table and kept in summary.json under `notes`.
        """
        return []

    def modal_sandbox(self) -> SandboxSpec | Mapping[str, Any] | None:
        """How the Modal runtime runs this environment's verifier in a sandbox (`runtime.modal.verify_in: sandbox`).

        None (the default): the verifier, with the run's options, on a plain image with no network.
        Return a `SandboxSpec`, or a dict of its fields, to change that: the
        Lean plugin names the kimina-lean-server image, starts it as a sidecar and points the verifier
        at it. Called in the orchestrator, on the environment built from the run's options.
        """
        return None

    def parse_options(self, options: Mapping[str, Any]) -> Any:
        """`options` validated by this environment's `Options` (an `OptionsError` names what is wrong and allowed)."""
        return validate_options(self.Options or EnvOptions, self.name, options)

    def task_from_data(self, data: dict[str, Any]) -> Task:
        """Build a task from inline JSON (used by `vrl verify` lines that carry their own task).

        The default accepts the fields of `Task` directly; environments may accept friendlier forms.
        """
        return Task.model_validate(data)

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise UnknownSplitError(f"environment {self.name!r} has no split {split!r}; splits: {', '.join(self.splits)}")


def validate_options(model: type[BaseModel], env: str, options: Mapping[str, Any]) -> Any:
    """Validate environment options; the error names the bad option and what is allowed, in one line."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        problems = []
        unknown = False
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(options)"
            if err["type"] == "extra_forbidden":
                unknown = True
                problems.append(f"unknown option {key!r}")
            elif err["type"] == "missing":
                field = model.model_fields.get(str(err["loc"][0]))
                problems.append(f"option {key!r} is required" + (f" ({field.description})" if field and field.description else ""))
            elif not err["loc"]:  # a rule across options (a model validator)
                problems.append(err["msg"].removeprefix("Value error, "))
            else:
                field = model.model_fields.get(str(err["loc"][0]))
                allowed = f" (allowed: {describe_option(field)})" if field is not None else ""
                problems.append(f"-o {key}={err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}{allowed}")
        listing = allowed_options(model) if unknown else ""
        hint = f"; {env} accepts {listing}" if listing else ("; it takes no options" if unknown else "")
        raise OptionsError(f"environment {env!r}: {'; '.join(problems)}{hint}") from None


def allowed_options(model: type[BaseModel]) -> str:
    """`name (type, default X)` for every option, comma-separated."""
    return ", ".join(f"{name} ({describe_option(field)})" for name, field in model.model_fields.items())


def describe_option(field: FieldInfo) -> str:
    """An option's type, bounds and default, short: `int >= 1, default 1000`."""
    bounds = [f"{sign} {getattr(meta, attr)}" for meta in field.metadata
              for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(meta, attr, None) is not None]
    text = type_name(field.annotation) + (f" {' and '.join(bounds)}" if bounds else "")
    if field.is_required():
        return f"{text}, required"
    return f"{text}, default {field.get_default(call_default_factory=True)!r}"


def options_model(factory: Callable[..., Any]) -> type[BaseModel] | None:
    """The options model of an environment factory: its `Options`, or one built from its signature.

    None when the signature takes `**kwargs` (anything goes) or cannot be read.
    """
    declared = getattr(factory, "Options", None)
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        return declared
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # an annotation that does not resolve: check names only
        hints = {}
    fields: dict[str, Any] = {}
    for i, (name, param) in enumerate(sig.parameters.items()):
        if isinstance(factory, type) and i == 0:  # self
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (hints.get(name, Any), default)
    return create_model(f"{getattr(factory, '__name__', 'Factory')}Options", __config__=ConfigDict(extra="forbid"), **fields)


def type_name(ann: Any) -> str:
    """A type annotation as docs and error messages show it: `int or None`, `'a' or 'b'`, `list[str]`."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin is collections.abc.Callable:
        return "function"
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return "None" if ann is type(None) else getattr(ann, "__name__", str(ann))
