"""Run configuration: one pydantic `TrainConfig`, loadable from YAML/TOML, overridable per field.

Layers, lowest first: field defaults < the environment's defaults < the config file < command-line
overrides (`--set sampling.temperature=0.7`); `resolve_config` layers them, for `vrl train` and for
Python alike (`TrainConfig(**fields)` too). Every field is documented here, once.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import contextvars
import copy
import difflib
import re
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from vrl.environment import type_name
from vrl.errors import UsageError

if TYPE_CHECKING:  # at run time `TrainConfig` is built from the plugins on first use (`__getattr__` below)
    TrainConfig = BaseModel

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")
RUN_NAME_RULE = (
    "a run name must be a single directory name (letters, digits and . _ + = @ -, starting with a letter or "
    "digit, at most 200 characters), not a path; set logging.runs_dir to choose the parent directory"
)


class Section(BaseModel):
    """A config section: unknown keys and values of the wrong type are errors; assignments are checked too.

    Base of the sections optimizers, generator backends and runtimes define (their `Config`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name: str, value: Any) -> None:
        """An assignment that is not valid is a one-line `ConfigError`, as in `TrainConfig(...)` (not a pydantic dump)."""
        if name not in type(self).model_fields and not name.startswith("_"):
            raise ConfigError(f"invalid configuration: {name}: {unknown_field(name, type(self))}")
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, section=type(self))) from None


class SamplingConfig(Section):
    """How completions are sampled."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0: off.")
    min_p: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Drop tokens less likely than min_p times the most likely one (after the temperature); null: off.",
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0,
        description="Divide the positive logits (multiply the negative ones) of every token already in the prompt or "
        "the completion by this before the temperature; 1.0: off. GRPO's log-probs apply the same penalty "
        "(docs/grpo.md).",
    )
    generation_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Further sampler arguments, passed through (transformers' GenerationConfig with hf, vLLM's "
        "SamplingParams with vllm) and overriding the fields above where they name the same setting. Whatever the "
        "checkpoint's own generation_config says, the sampler uses these fields and nothing else.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the chat template (TRL's name; a dict or its JSON text), wherever vrl "
        "applies it: prompts and episodes' messages, hf and vllm, e.g. {\"enable_thinking\": false} for Qwen3.",
    )
    max_new_tokens: int = Field(64, ge=1, description="Cap on generated tokens per completion.")
    stop: list[str] = Field(default_factory=list, description="Stop strings; the completion ends after the first one.")
    batch_size: int = Field(
        32, ge=1, description="Prompts per generation batch; each finished batch streams to the verifier."
    )

    #: The fields every backend's sampler applies (and `generation_kwargs` may override by these names).
    PROCESSORS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """A JSON object's text (TRL accepts one from the command line) as its dict; None as no arguments."""
        if value is None:
            return {}
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc.msg}") from None
        return value

    def effective(self) -> dict[str, Any]:
        """The sampling parameters the sampler uses: the fields, with `generation_kwargs`' values for the same names."""
        values = {name: getattr(self, name) for name in self.PROCESSORS}
        values.update({k: v for k, v in self.generation_kwargs.items() if k in values})
        return values


class GeneratorConfig(Section):
    """Which backend generates, and the model settings every backend reads. A backend's own settings
    are its section, `generator.<backend>` (defined by the backend's class: `Generator.Config`)."""

    backends: ClassVar[tuple[str, ...]] = ()  # the registered backends (`build_config_model` sets them)

    backend: str = Field(
        "hf", description="'hf' (transformers, CPU or GPU), 'vllm' (GPU), or a backend a plugin registers "
        "(`vrl plugins` lists them)."
    )
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bfloat16 on GPU, float32 on CPU."
    )
    revision: str | None = Field(None, description="Model revision (branch, tag or commit) on the Hugging Face Hub.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return _registered(value, cls.backends, "generator backend")


class VerifierConfig(Section):
    """How attempts are sent to the verifier."""

    batch_size: int = Field(64, ge=1, description="Attempts per verify() call.")
    concurrency: int = Field(4, ge=1, description="verify() calls in flight at once.")
    timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock cap for one verify() call; an overrun scores the batch as timeouts."
    )
    max_error_fraction: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Stop the run (exit 2, before the update) when more than this share of an iteration's verdicts "
        "are the verifier's own errors (its code raised or broke the contract), and always when all are; below it "
        "each kind of error is reported once on the console and its attempts are crashed verdicts with no reward (GRPO: "
        "NaN, out of the group statistics and the update; ES: out of the member's fitness; never 0).",
    )


class RuntimeConfig(Section):
    """Where generation and verification run. A runtime's own settings are its section,
    `runtime.<kind>` (defined by the runtime's class: `Runtime.Config`)."""

    kinds: ClassVar[tuple[str, ...]] = ()  # the registered runtimes (`build_config_model` sets them)

    kind: str = Field(
        "local", description="'local': this machine; 'modal': GPU functions and verifier sandboxes on Modal; or a "
        "runtime a plugin registers (`vrl plugins` lists them)."
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        return _registered(value, cls.kinds, "runtime")


def _registered(value: str, names: tuple[str, ...], what: str) -> str:
    """`value` if it names a registered update rule, backend or runtime; else one line listing them."""
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; installed: {', '.join(names) or 'none'} (`vrl plugins` lists them)")
    return value


class LoggingConfig(Section):
    """Run directory and what goes in it."""

    runs_dir: Path = Field(Path("runs"), description="Parent directory of run directories.")
    name: str | None = Field(
        None, description="Run name, a single directory name under runs_dir; default: <plugin>-<optimizer>-<timestamp>-<4 hex>."
    )
    samples_per_iteration: int = Field(
        8, ge=0, description="Completions (with verdicts) written to samples.jsonl per iteration."
    )
    mlflow: bool = Field(
        False,
        description="Also log metrics to MLflow: to MLFLOW_TRACKING_URI if set, else to a SQLite store "
        "<runs_dir>/.mlflow/mlflow.db.",
    )
    mlflow_experiment: str = Field("vrl", description="MLflow experiment name.")
    wandb: bool = Field(False, description="Also log metrics to Weights & Biases (WANDB_MODE=offline works without network).")
    wandb_project: str = Field("vrl", description="W&B project name.")
    sinks_best_effort: bool = Field(
        False,
        description="A metric sink (MLflow, W&B) that cannot start is skipped with a warning instead of stopping "
        "the run before its first iteration.",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str | None) -> str | None:
        if name is not None and not RUN_NAME_RE.fullmatch(name):
            raise ValueError(RUN_NAME_RULE)
        return name


class CurriculumConfig(Section):
    """Which tasks are drawn (`vrl.curriculum`, `vrl.schedule`): a pass-rate curriculum retires tasks the policy
    always or never solves and re-admits a few; for GRPO and ES alike (docs/grpo.md, docs/es.md)."""

    kind: Literal["none", "pass_rate"] = Field(
        "none", description="'none': every task in turn; 'pass_rate': retire a task whose estimated pass rate is at or "
        "below band_low (too hard) or at or above band_high (too easy), from the raw verdicts of its attempts.",
    )
    band_low: float = Field(0.0, ge=0.0, le=1.0, description="A task estimated at or below this pass rate is retired "
                            "as too hard (with kind=pass_rate).")
    band_high: float = Field(1.0, ge=0.0, le=1.0, description="A task estimated at or above this pass rate is "
                             "retired as too easy (with kind=pass_rate).")
    min_observations: int = Field(2, ge=1, description="Iterations a task must have been drawn in before it can be "
                                  "retired (with kind=pass_rate); a task found defective is retired at once.")
    readmit_prob: float = Field(0.05, ge=0.0, le=1.0, description="Chance that a retired task is drawn again when "
                                "its turn comes (with kind=pass_rate; a seeded coin per turn).")
    estimator: Literal["last", "ema", "max"] = Field(
        "ema", description="A task's estimated pass rate from its observations (with kind=pass_rate): the 'last', an "
        "exponential moving average ('ema', weight ema_weight on the newest), or the 'max' (once solved, easy).",
    )
    ema_weight: float = Field(0.5, gt=0.0, le=1.0, description="Weight of the newest observation (with "
                              "estimator=ema).")

    @model_validator(mode="after")
    def _check(self) -> CurriculumConfig:
        defaults = type(self).model_fields
        stray = sorted(f for f in defaults if f != "kind" and getattr(self, f) != defaults[f].default)
        if self.kind == "none" and stray:
            raise ValueError(f"curriculum.{', curriculum.'.join(stray)} only apply to a curriculum; set "
                             "curriculum.kind=pass_rate or remove them")
        if self.band_low >= self.band_high:
            raise ValueError(f"curriculum.band_low ({self.band_low}) must be below curriculum.band_high "
                             f"({self.band_high})")
        if self.estimator != "ema" and self.ema_weight != defaults["ema_weight"].default:
            raise ValueError(f"curriculum.ema_weight only applies to curriculum.estimator=ema (got estimator="
                             f"{self.estimator}); remove it or set estimator=ema")
        return self


class _RunConfig(Section):
    """Everything a training run needs. `vrl train --help` lists the flags that set these."""

    optimizers: ClassVar[tuple[str, ...]] = ()  # the registered update rules (`build_config_model` sets them)
    _registry: ClassVar[Any] = None  # a weak reference to the plugins' registry the class was built from

    plugin: str = Field("countdown", description="Environment name, as listed by `vrl plugins`.")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options passed to the environment (e.g. a server URL)."
    )
    model: str = Field("tiny", description="Hugging Face model id or local path; 'tiny' builds a small local model.")
    optimizer: str = Field(
        "es", description="Update rule: 'es', 'grpo', or a rule a plugin registers (`vrl plugins` lists them); its "
        "settings are the section named after it."
    )
    iterations: int = Field(10, ge=1, description="Training iterations.")
    tasks_per_iteration: int = Field(8, ge=1, description="Tasks drawn per iteration.")
    split: str = Field("train", description="Environment split to train on.")
    seed: int = Field(0, description="Seeds task order, sampling and the optimizer.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)

    def __init__(self, **fields: Any) -> None:
        """`TrainConfig(plugin="letters", iterations=10)`: the fields given, over the environment's suggested
        `defaults`, over each field's default: what `vrl train --plugin letters --iterations 10` runs
        (`resolve_config` layers them; a plugin name no installed plugin registered adds no defaults). A bad field
        is a one-line `ConfigError`."""
        layer = {key: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
                 for key, value in fields.items()}
        plugin = layer.get("plugin", type(self).model_fields["plugin"].default)
        registry = type(self)._registry() if type(self)._registry is not None else None
        given = _AS_GIVEN.get() or not isinstance(plugin, str)
        merged = layer if given else merge(environment_defaults(plugin, registry, strict=False), layer)
        check_moved(merged)
        try:
            super().__init__(**merged)
        except ValidationError as exc:
            if _AS_GIVEN.get():  # inside `model_validate`: pydantic's error (`build` says it in one line)
                raise
            raise ConfigError(format_validation_error(exc)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        """Validate data as it is (a recorded config, a config sent to a worker): no environment defaults are
        added, unlike `TrainConfig(**fields)`. Errors are pydantic's (`build` words them in one line)."""
        token = _AS_GIVEN.set(True)
        try:
            return super().model_validate(obj, **kwargs)
        finally:
            _AS_GIVEN.reset(token)

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return _registered(value, cls.optimizers, "optimizer")

    @model_validator(mode="after")
    def _check_plugin(self) -> _RunConfig:
        if not self.plugin.strip():
            raise ValueError("plugin must be a non-empty environment name")
        return self


_MODELS: weakref.WeakKeyDictionary[Any, type[BaseModel]] = weakref.WeakKeyDictionary()


def config_model(registry: Any) -> type[BaseModel]:
    """The `TrainConfig` class of a registry of plugins (`vrl.plugins.Registry`), built once per registry."""
    if registry not in _MODELS:
        _MODELS[registry] = build_config_model(registry)
    return _MODELS[registry]


def build_config_model(registry: Any) -> type[BaseModel]:
    """The `TrainConfig` class for a registry of plugins (`config_model` keeps one per registry).

    The run's fields, plus one section per registered update rule (`es`, `grpo`: the class's
    `Config`), per generator backend (`generator.hf`, `generator.vllm`) and per runtime
    (`runtime.local`, `runtime.modal`). Adding any of them needs no edit here.
    """

    def sections(kind: str, base: type[BaseModel], where: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in registry.names(kind):
            if name in base.model_fields:  # a section may not shadow a field (an optimizer named 'seed')
                registry._conflicts.append(f"{kind[:-1]} {name!r} cannot be configured: {where}{name} is already "
                                          "a field; it was left out")
                continue
            section = registry.factory(kind, name).Config
            out[name] = (section, Field(default_factory=section, description=(section.__doc__ or "").strip()))
        return out

    generator = create_model("GeneratorConfig", __base__=GeneratorConfig, __module__=__name__,
                             **sections("generators", GeneratorConfig, "generator."))
    generator.backends = tuple(n for n in generator.model_fields if n not in GeneratorConfig.model_fields)
    generator.__doc__ = GeneratorConfig.__doc__
    runtime = create_model("RuntimeConfig", __base__=RuntimeConfig, __module__=__name__,
                           **sections("runtimes", RuntimeConfig, "runtime."))
    runtime.kinds = tuple(n for n in runtime.model_fields if n not in RuntimeConfig.model_fields)
    runtime.__doc__ = RuntimeConfig.__doc__
    rules = sections("optimizers", _RunConfig, "")
    model = create_model("TrainConfig", __base__=_RunConfig, __module__=__name__,
                         generator=(generator, Field(default_factory=generator)),
                         runtime=(runtime, Field(default_factory=runtime)), **rules)
    model.optimizers = tuple(rules)
    model._registry = weakref.ref(registry)
    model.__doc__ = _RunConfig.__doc__
    return model


def train_config() -> type[BaseModel]:
    """The `TrainConfig` class of the installed plugins (`vrl.config.TrainConfig` is the same class)."""
    from vrl.plugins import registry  # here: the registry loads plugins, which import vrl.config

    return config_model(registry())


def __getattr__(name: str) -> Any:
    # `TrainConfig` depends on the registered plugins, so it is built on first use, not on import.
    if name == "TrainConfig":
        return train_config()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Keys that moved when sections began to nest by kind (issue 28): old dotted key -> new dotted key.
#: A config file or `--set` that uses an old key is an error naming the new one; a run directory
#: recorded with old keys is migrated when it is loaded (`migrate`), so old runs still resume.
MOVED: dict[str, str] = {
    "generator.threads": "generator.hf.threads",
    **{f"generator.{k}": f"generator.vllm.{k}" for k in (
        "gpu_memory_utilization", "max_model_len", "enforce_eager", "max_num_seqs", "tensor_parallel_size", "sleep",
        "sync_every", "sampling_logprobs")},
    "generator.engines": "runtime.local.engines",
    "generator.gpus": "runtime.local.gpus",
    **{f"runtime.{k}": f"runtime.modal.{k}" for k in (
        "app_name", "gpu", "cpu", "memory_mb", "timeout_s", "retries", "max_containers", "scaledown_window_s", "volume",
        "secrets", "detach", "orchestrator_gpu", "verify_in", "sandboxes", "sandbox_mode", "sandbox_cpu",
        "sandbox_memory_mb", "sandbox_timeout_s", "sandbox_start_timeout_s", "block_network")},
}


def moved_keys(data: dict[str, Any]) -> list[str]:
    """The old keys (`MOVED`) that `data` (a nested config mapping) still uses."""
    return [old for old in MOVED if _get(data, old) is not _ABSENT]


def check_moved(data: dict[str, Any]) -> None:
    """A `ConfigError` naming the new key of every moved key `data` uses (one line)."""
    old = moved_keys(data)
    if old:
        raise ConfigError("invalid configuration: " + " | ".join(f"{k}: moved to {MOVED[k]}" for k in old))


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (a run directory's config.json) with its moved keys put where they are now."""
    out = copy.deepcopy(data)
    for old in moved_keys(out):
        value = _pop(out, old)
        if _get(out, MOVED[old]) is _ABSENT:
            out = merge(out, nest({MOVED[old]: value}))
    return out


_ABSENT = object()


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _pop(data: dict[str, Any], dotted: str) -> Any:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node[part]
    return node.pop(last)


class ConfigError(UsageError, ValueError):
    """A configuration problem, phrased for the user (field, value, what is allowed)."""


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a mapping at the top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> dict[str, Any]:
    """'sampling.temperature=0.7' -> {'sampling': {'temperature': 0.7}} (the value is parsed as YAML)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key=value, e.g. sampling.temperature=0.7")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return nest({key.strip(): value})


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Expand dotted keys into nested dicts."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with a non-mapping value at {part!r}")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `top` over `base` (mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def build(*layers: dict[str, Any]) -> TrainConfig:
    """Validate merged layers into a TrainConfig as they are (no environment defaults are added:
    `resolve_config` adds them); errors name each bad field and what is allowed (a key that moved names its new place:
    `runtime.gpu: moved to runtime.modal.gpu`)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = merge(merged, layer)
    check_moved(merged)
    try:
        return train_config().model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


#: Set while `TrainConfig.model_validate` runs: `TrainConfig.__init__` (which pydantic's `model_validate` calls)
#: then adds no environment defaults.
_AS_GIVEN: contextvars.ContextVar[bool] = contextvars.ContextVar("vrl_config_as_given", default=False)


def environment_defaults(environment: Any, registry: Any = None, *, strict: bool = True) -> dict[str, Any]:
    """The settings an environment suggests (its `defaults`), as a nested config layer.

    `environment`: a registered name (looked up in `registry`, default: the installed plugins'), or an
    `Environment` class or object. An unknown name is an `UnknownNameError` (with `strict=False`: no defaults).
    """
    if isinstance(environment, str):
        if registry is None:
            from vrl.plugins import registry as installed  # here: the registry loads plugins, which import vrl.config

            registry = installed()
        try:
            environment = registry.factory("environments", environment)
        except LookupError:
            if strict:
                raise
            return {}
    out: dict[str, Any] = {}
    for key, value in dict(getattr(environment, "defaults", None) or {}).items():
        out = merge(out, nest({key: copy.deepcopy(value)}))
    return out


def resolve_config(fields: Mapping[str, Any] | None = None, *, file: str | Path | None = None,
                   overrides: Iterable[str] | Mapping[str, Any] = (), environment: Any = None,
                   base: Mapping[str, Any] | None = None) -> TrainConfig:
    """The configuration of a run, as `vrl train` resolves it. Layers, lowest first:

    each field's default < the environment's suggested `defaults` < `base` (a resumed run's recorded
    config, which already holds its environment's defaults, so they are not added again) < the config
    `file` (YAML or TOML) < `fields` < `overrides` (`"key=value"` strings as `--set` takes, or a mapping).

    Keys may be dotted (`{"es.sigma": 0.1}`). `environment`: whose `defaults` to layer, a registered name
    (default: the `plugin` the layers name) or an `Environment` class or object (whose name becomes
    `plugin` unless the layers name one). Every problem is a one-line `UsageError` (`ConfigError` for a
    bad field; `UnknownNameError` for an environment no plugin registered).
    """
    base_layer = migrate(dict(base)) if base else {}
    file_layer = load_file(file) if file else {}
    field_layer: dict[str, Any] = {}
    for key, value in (fields or {}).items():
        if isinstance(value, BaseModel):  # a section given whole: the fields it was given
            value = value.model_dump(exclude_unset=True)
        field_layer = merge(field_layer, nest({key: value}))
    if isinstance(overrides, Mapping):
        pairs = [nest({key: value}) for key, value in overrides.items()]
    else:
        pairs = [parse_override(item) for item in ([overrides] if isinstance(overrides, str) else overrides)]
    over_layer: dict[str, Any] = {}
    for pair in pairs:
        over_layer = merge(over_layer, pair)
    upper = merge(merge(merge(base_layer, file_layer), field_layer), over_layer)
    if environment is not None and not isinstance(environment, str) and "plugin" not in upper:
        upper["plugin"] = environment.name
    if base:
        return build(upper)
    if environment is None:
        environment = upper.get("plugin", _RunConfig.model_fields["plugin"].default)
    return build(environment_defaults(environment), upper)


def format_validation_error(exc: ValidationError, section: type[BaseModel] | None = None) -> str:
    """One line: each bad field, what is wrong with it, the value given (errors apart by ' | ').

    `section`: the model the error's field paths start from (default: `TrainConfig`)."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            parent = _section_for(err["loc"][:-1], section)
            if parent is not None:
                prefix = "".join(f"{p}." for p in err["loc"][:-1])
                msg = unknown_field(str(err["loc"][-1]), parent, prefix)
        value = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(value, dict) or repr(value) in msg else f" (got {value!r})"
        lines.append(f"{field}: {msg}{shown}")
    return "invalid configuration: " + " | ".join(lines)


def unknown_field(name: str, model: type[BaseModel], prefix: str = "") -> str:
    """What to say of a field `name` that `model` (the section at `prefix`) lacks: the field meant, when
    `name` is another tool's name for it (the model's `other_names`, e.g. TRL's for GRPO) or a close
    spelling of one, then every known field."""
    fields = sorted(model.model_fields)
    other: dict[str, str] = getattr(model, "other_names", {})
    close = difflib.get_close_matches(name, fields, n=1)
    meant = other.get(name) or (f"{prefix}{close[0]}" if close else None)
    return f"unknown field; {f'did you mean {meant}? ' if meant else ''}known fields: {', '.join(fields)}"


def _section_for(loc: tuple, model: type[BaseModel] | None = None) -> type[BaseModel] | None:
    model = model or train_config()
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def dump(config: TrainConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able data (what a run directory records)."""
    return config.model_dump(mode="json")


def field_table(model: type[BaseModel] | None = None) -> str:
    """Every config field of `model` (default: this installation's `TrainConfig`), grouped by section
    as TRL's docs are: a heading and the section's own description, then a markdown table (dotted
    name, type, default, description)."""
    out: list[str] = []

    def section(model: type[BaseModel], prefix: str, title: str, doc: str) -> None:
        rows, nested = [], []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((ann, f"{prefix}{name}"))
                continue
            default = field.get_default(call_default_factory=True)
            shown = str(default) if not isinstance(default, str) else repr(default)
            kind = type_name(ann)
            desc, kind = (field.description or "").replace("|", "\\|"), kind.replace("|", "\\|")
            rows.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {desc} |")
        out.append(f"### {title}\n")
        if doc:
            out.append(" ".join(doc.split()) + "\n")
        if rows:
            out.append("\n".join(["| field | type | default | description |", "|---|---|---|---|", *rows]) + "\n")
        else:
            out.append("No settings.\n")
        for sub, name in nested:
            section(sub, f"{name}.", f"`{name}`", (sub.__doc__ or "").strip())

    section(model or train_config(), "", "The run", "The top-level fields.")
    return "\n".join(out)


def builtin_config_model() -> type[BaseModel]:
    """The `TrainConfig` of vrl alone, without installed plugins (what docs/config.md documents)."""
    from vrl.plugins import Registry

    return config_model(Registry().load(entry_points=False))


if __name__ == "__main__":  # python -m vrl.config: refresh the field tables in docs/config.md
    import sys

    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
    text = doc.read_text()
    start, end = "<!-- fields:start -->\n", "<!-- fields:end -->"
    head, tail = text[: text.index(start) + len(start)], text[text.index(end) :]
    doc.write_text(head + field_table(builtin_config_model()) + tail)
