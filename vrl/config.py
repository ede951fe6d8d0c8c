"""Run configuration: one pydantic `TrainConfig`, loadable from YAML/TOML, overridable per field.

Layers, lowest first: field defaults < the environment's defaults < the config file < command-line
overrides (`--set sampling.temperature=0.7`). Every field is documented here, once.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from vrl.errors import UsageError
from vrl.optim import OPTIMIZERS, optimizer_class

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")
RUN_NAME_RULE = (
    "a run name must be a single directory name (letters, digits and . _ + = @ -, starting with a letter or "
    "digit, at most 200 characters), not a path; set logging.runs_dir to choose the parent directory"
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Section):
    """How completions are sampled."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(64, ge=1, description="Cap on generated tokens per completion.")
    stop: list[str] = Field(default_factory=list, description="Stop strings; the completion ends after the first one.")
    batch_size: int = Field(
        32, ge=1, description="Prompts per generation batch; each finished batch streams to the verifier."
    )


class GeneratorConfig(_Section):
    """Which backend generates, and where."""

    backend: Literal["hf", "vllm"] = Field("hf", description="'hf' (transformers, CPU or GPU) or 'vllm' (GPU).")
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bfloat16 on GPU, float32 on CPU."
    )
    revision: str | None = Field(None, description="Model revision (branch, tag or commit) on the Hugging Face Hub.")
    threads: int | None = Field(
        None, ge=1,
        description="hf: torch's intra-op CPU threads, set process-wide when the model loads. None: 1 for the "
        "tiny model on CPU (its matrices gain nothing from more, and one thread per core is many times slower "
        "when other processes keep the cores busy; docs/config.md); other models keep torch's default (one per "
        "core), as does GPU generation.",
    )
    gpu_memory_utilization: float = Field(
        0.6, gt=0.0, le=1.0,
        description="vllm: fraction of GPU memory the engine may take (weights + KV cache); leave room for "
        "in-engine ES state (4 bytes per selected parameter) or GRPO training on the same GPU.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vllm: longest prompt + completion in tokens; None: the model's own limit."
    )
    enforce_eager: bool = Field(
        False, description="vllm: skip torch.compile and CUDA graphs (starts ~3x faster, generates ~3x slower)."
    )
    max_num_seqs: int = Field(
        512, ge=1,
        description="vllm: most sequences one engine step decodes. 512 is the largest batch vLLM captures in a "
        "CUDA graph by default; steps above it run without graphs (vLLM's own default on 80 GB GPUs is 1024: "
        "2.5x slower for a 1920-request low-rank ES pass on one H100, docs/benchmarks.md).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vllm: GPUs one engine shards the model over (in-engine ES needs 1)."
    )
    sleep: bool = Field(
        False,
        description="vllm + grpo: the engine frees its GPU memory after each generation pass so training can use "
        "it (colocated mode), and wakes for the weight sync.",
    )
    sync_every: int = Field(
        1, ge=1,
        description="vllm + grpo: push the trained weights into the engine every k updates; in between the engine "
        "samples slightly stale weights and GRPO's importance ratio uses the engine's log-probs.",
    )
    sampling_logprobs: bool = Field(
        True,
        description="vllm + grpo: the engine returns each sampled token's log-prob and GRPO's importance ratio "
        "uses it (corrects for sampler/trainer numerics and stale weights). Costs about 40% of generation "
        "throughput at 1.5B (docs/benchmarks.md); false: the ratio uses the trainer's own log-probs.",
    )

    engines: int = Field(
        1, ge=1,
        description="Sampling engines, each with its own copy of the weights: ES deals its members over them, "
        "GRPO shards the tasks and publishes trained weights to all. Local runtime only.",
    )
    gpus: list[int] | None = Field(
        None,
        description="GPU indices the engines are dealt over (round-robin); engines sharing a GPU split "
        "gpu_memory_utilization evenly. None: one GPU (vllm) or generator.device (hf).",
    )

    @model_validator(mode="after")
    def _check_logprobs(self) -> GeneratorConfig:
        if self.sync_every > 1 and not self.sampling_logprobs:
            raise ValueError(
                "generator.sync_every > 1 samples from weights up to k-1 updates old, which only the engine's own "
                "log-probs can correct for; keep generator.sampling_logprobs=true or set generator.sync_every=1"
            )
        return self


class VerifierConfig(_Section):
    """How attempts are sent to the verifier."""

    batch_size: int = Field(64, ge=1, description="Attempts per verify() call.")
    concurrency: int = Field(4, ge=1, description="verify() calls in flight at once.")
    timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock cap for one verify() call; an overrun scores the batch as timeouts."
    )


class RuntimeConfig(_Section):
    """Where generation and verification run. The fields after `kind` apply to `kind: modal` (docs/modal.md)."""

    kind: str = Field(
        "local", description="'local': this machine; 'modal': GPU functions and verifier sandboxes on Modal "
        "(the list: vrl.runtime.RUNTIMES)."
    )
    app_name: str = Field("vrl", min_length=1, description="Modal app name (shown in the Modal dashboard).")
    gpu: str = Field("H100", min_length=1, description="GPU type of the generation functions, e.g. 'H100', 'A100-80GB', 'L40S'.")
    cpu: float = Field(4.0, gt=0, description="CPU cores reserved per GPU container.")
    memory_mb: int = Field(65536, ge=1024, description="Memory (MiB) reserved per GPU container.")
    timeout_s: int = Field(3600, ge=10, description="Wall-clock cap for one GPU call (an ES member or a generation shard).")
    retries: int = Field(2, ge=0, le=10, description="Retries of a failed GPU call (preemption, OOM) before the run fails.")
    max_containers: int = Field(
        30, ge=1, description="GPU containers at most (ES: members evaluated at once; GRPO: shards at once)."
    )
    scaledown_window_s: int = Field(
        300, ge=2, description="Seconds an idle GPU container stays warm (keeps the base weights and replayed ES state)."
    )
    volume: str = Field("vrl", min_length=1, description="Modal Volume holding base weights, the HF cache and run directories.")
    secrets: list[str] = Field(
        default_factory=list,
        description="Modal Secret names (e.g. 'huggingface'), mounted on `vrl modal prepare` and the detached "
        "orchestrator only; never on GPU workers or verifier sandboxes, never logged.",
    )
    detach: bool = Field(False, description="Run the orchestrator itself on Modal; the run directory lives on the Volume.")
    orchestrator_gpu: str | None = Field(
        None, description="GPU for the detached orchestrator (GRPO trains there); None: CPU only (ES needs none)."
    )
    verify_in: Literal["sandbox", "local"] = Field(
        "sandbox", description="'sandbox': verifiers run in Modal Sandboxes; 'local': in the orchestrator process."
    )
    sandboxes: int = Field(0, ge=0, description="Verifier sandboxes in the pool; 0: sized from the batch.")
    sandbox_mode: Literal["pool", "per_attempt"] = Field(
        "pool", description="'pool': long-lived warm sandboxes; 'per_attempt': a fresh sandbox for every attempt."
    )
    sandbox_cpu: float = Field(2.0, gt=0, description="CPU cores per verifier sandbox.")
    sandbox_memory_mb: int = Field(8192, ge=256, description="Memory (MiB) per verifier sandbox.")
    sandbox_timeout_s: int = Field(3600, ge=60, description="Lifetime of a verifier sandbox; the pool replaces expired ones.")
    sandbox_start_timeout_s: float = Field(
        600.0, gt=0, description="How long a sandbox may take to become healthy (a Lean server imports Mathlib)."
    )
    block_network: bool = Field(True, description="Verifier sandboxes get no network (model-written code runs there).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        from vrl.runtime import RUNTIMES

        return _one_of(value, RUNTIMES)


def _one_of(value: str, registry: dict[str, str]) -> str:
    """`value` if it names an entry of `registry` (an update rule, a runtime); else the choices."""
    if value not in registry:
        raise ValueError(f"Input should be {' or '.join(map(repr, registry))}")
    return value


class LoggingConfig(_Section):
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


class _RunConfig(_Section):
    """Everything a training run needs. `vrl train --help` lists the flags that set these."""

    plugin: str = Field("countdown", description="Environment name, as listed by `vrl plugins`.")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options passed to the environment (e.g. a server URL)."
    )
    model: str = Field("tiny", description="Hugging Face model id or local path; 'tiny' builds a small local model.")
    optimizer: str = Field("es", description="Update rule: 'es' or 'grpo' (the list: vrl.optim.OPTIMIZERS).")
    iterations: int = Field(10, ge=1, description="Training iterations.")
    tasks_per_iteration: int = Field(8, ge=1, description="Tasks drawn per iteration.")
    split: str = Field("train", description="Environment split to train on.")
    seed: int = Field(0, description="Seeds task order, sampling and the optimizer.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return _one_of(value, OPTIMIZERS)

    @model_validator(mode="after")
    def _check_plugin(self) -> _RunConfig:
        if not self.plugin.strip():
            raise ValueError("plugin must be a non-empty environment name")
        return self


def _optimizer_sections() -> dict[str, Any]:
    """One section per registered update rule, named after it (`es`, `grpo`), holding its settings."""
    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        section = optimizer_class(name).Config
        out[name] = (section, Field(default_factory=section, description=(section.__doc__ or "").strip()))
    return out


# The run's settings plus one section per update rule: a new rule needs no edit here.
TrainConfig = create_model("TrainConfig", __base__=_RunConfig, __module__=__name__, **_optimizer_sections())
TrainConfig.__doc__ = _RunConfig.__doc__


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
    """Validate merged layers into a TrainConfig; errors name each bad field and what is allowed."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = merge(merged, layer)
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    """One line: each bad field, what is wrong with it, the value given (errors apart by ' | ')."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            parent = _section_for(err["loc"][:-1])
            if parent is not None:
                msg += f"; known fields: {', '.join(sorted(parent.model_fields))}"
        value = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{field}: {msg}{shown}")
    return "invalid configuration: " + " | ".join(lines)


def _section_for(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = TrainConfig
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


def field_table() -> str:
    """A markdown table of every config field (dotted name, type, default, description)."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = str(default) if not isinstance(default, str) else repr(default)
            kind = _type_name(ann)
            desc, kind = (field.description or "").replace("|", "\\|"), kind.replace("|", "\\|")
            rows.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {desc} |")

    walk(TrainConfig, "")
    return "\n".join(rows) + "\n"


def _type_name(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if ann is type(None) else getattr(ann, "__name__", str(ann))


if __name__ == "__main__":  # python -m vrl.config: refresh the field table in docs/config.md
    import sys

    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
    text = doc.read_text()
    start, end = "<!-- fields:start -->\n", "<!-- fields:end -->"
    head, tail = text[: text.index(start) + len(start)], text[text.index(end) :]
    doc.write_text(head + field_table() + tail)
