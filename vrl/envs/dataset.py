"""`dataset`: train on any dataset with reward functions in TRL's shape, no plugin needed.

    vrl train --plugin dataset -o data=problems.jsonl -o prompt_column=question \\
        -o reward=rewards.py:accuracy,rewards.py:brevity -o reward_weights=[1.0,0.2]

Rows come from a local JSONL, JSON (a list of objects), CSV or Parquet file, or a Hugging Face
dataset id (loaded with `datasets`). The prompt column holds plain text or chat messages (the
generator applies the model's chat template to messages); every other column reaches the reward
functions as a keyword list (see `vrl.reward_functions`). From Python, pass callables::

    env = DatasetEnvironment(data="problems.jsonl", prompt_column="question", rewards=[accuracy, brevity],
                             reward_weights=[1.0, 0.2])
    vrl.Trainer(config, environment=env).run()

A local file is one split, `train`; a Hub dataset has its own, and `split` / `test_split` say which
serve vrl's `train` (training) and `test` (`vrl eval`) splits. A malformed row is an error naming
the file and row, raised before anything is generated. With one TRL `environment_factory` class, `data` may be
left out: the environment owns the data (placeholder rows; each episode's `reset()` gives its prompt, as in TRL).
"""

from __future__ import annotations

import csv
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator

from vrl.environment import Environment, EnvOptions
from vrl.episodes import InstancePool
from vrl.errors import DatasetUnavailable, OptionsError, UnknownSplitError, UsageError
from vrl.reward_functions import (
    RESERVED,
    RewardFunctions,
    RewardFunctionShaper,
    RewardFunctionVerifier,
    load_reward_function,
)
from vrl.tools import ToolInteraction, schema, tool_schemas
from vrl.types import Task

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
ENVIRONMENT_COLUMN = "environment"  # with a dict environment_factory: the row's environment (TRL's name)
PLACEHOLDER = {"role": "user", "content": ""}  # a row without a prompt: reset() supplies it (TRL's placeholder)
#: Without data: the placeholder rows of the one split, `train` (more than an iteration draws; they differ by id only).
PLACEHOLDER_ROWS = 1024


class MalformedDataset(UsageError, ValueError):
    """A dataset row that cannot become a task; the message names the source and the row."""


class DatasetOptions(EnvOptions):
    """`-o` options of the dataset environment."""

    data: str | None = Field(None, description="A .jsonl, .json, .csv or .parquet file, or a Hugging Face dataset id "
                             "(`owner/name`, loaded with `datasets`). Optional with one environment_factory class: "
                             "without data, the environment owns it (TRL's dataset-less training): placeholder rows, "
                             "each episode's reset() gives its prompt.")
    reward: list[str | Callable[..., Any]] = Field(
        [], validation_alias=AliasChoices("reward", "rewards"),
        description="Reward functions: `module:function` or `path/to/file.py:function`, comma-separated or a list "
        "(from Python: the callables, as `rewards=[...]`). Optional with an environment_factory that has get_reward.")
    tool: list[str | Callable[..., Any]] = Field(
        [], validation_alias=AliasChoices("tool", "tools"),
        description="Tools the model may call (TRL's `tools`): typed, docstring'd functions, `module:function` "
        "(repeat -o tool=...); episodes then run up to max_turns model turns (docs/multi-turn.md).")
    environment_factory: str | Callable[..., Any] | dict[str, str | Callable[..., Any]] | None = Field(
        None, description="A TRL environment class (`module:Class`): instances reused from a pool, `reset(**row)` per "
        "episode, its public methods as tools, `get_reward()` as a reward function named after the class. A dict "
        "(-o environment_factory.NAME=module:Class, repeatable) routes each row by its `environment` column. With it, "
        "a row may lack the prompt column: reset() supplies the prompt.")
    max_turns: int = Field(4, ge=1, description="Most model turns of an episode with tools (TRL's "
                           "max_tool_calling_iterations + 1).")
    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="TRL's name for the most tool-calling rounds of an episode: max_turns = this + 1 "
        "(give one of the two).")
    max_completion_length: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_completion_length", "max_episode_tokens"),
        description="The token budget of a whole episode, the model's and the environment's tokens after the prompt "
        "(TRL's max_completion_length; vrl's other name: max_episode_tokens): a model turn is cut to what is left, "
        "tool results that would pass it are dropped and the episode ends, as in TRL. sampling.max_new_tokens "
        "stays each turn's own cap. Default: none (max_turns and each turn's cap bound an episode).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Wall-clock cap of one tool call; an overrun is a tool "
                                  "message with the error.")
    tool_feedback: Literal["trl", "detailed"] = Field(
        "trl", description="What the model reads back: 'trl' (TRL 1.16's texts: str(result), {'error': ...}; a turn "
        "with a malformed call ends the episode) or 'detailed' (JSON results, explained errors; a malformed call "
        "gets an error message and the episode goes on).")
    step_timeout_s: float = Field(60.0, gt=0, description="Wall-clock cap of one environment step: all of a turn's "
                                  "tool calls, which run one after another; an overrun ends the episode.")
    reward_weights: list[float] | None = Field(None, description="One weight per reward function (default: all 1).")
    prompt_column: str = Field("prompt", description="The column holding the prompt: text, or chat messages.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")
    id_column: str | None = Field(None, description="A column of unique task ids (default: `<split>-<row number>`).")
    split: str = Field("train", description="The dataset split vrl trains on (a local file is one split, `train`).")
    test_split: str = Field("test", description="The dataset split `vrl eval` uses (vrl's `test` split).")
    subset: str | None = Field(None, description="The configuration (subset) of a Hugging Face dataset.")
    pass_threshold: float = Field(1.0, description="A completion passes when its weighted reward reaches this.")
    reward_timeout_s: float = Field(60.0, gt=0, description="Wall-clock cap for one reward function call; an overrun "
                                    "is a failed verdict (the batch is retried one completion at a time).")
    judge_timeout_s: float | None = Field(None, gt=0, description="Cap on one request of a `judge:` reward, as a whole "
                                          "(connecting, waiting, reading); default 15 s.")
    judge_retries: int | None = Field(None, ge=0, description="Retries of a `judge:` request that timed out, could not "
                                      "connect or got 429/5xx (backoff 0.5 s, doubling); default 2. (timeout × tries + "
                                      "backoff) must fit in 90% of reward_timeout_s.")
    judge_concurrency: int | None = Field(None, ge=1, description="Most `judge:` requests in flight; default 8.")
    judge_key_over_http: bool = Field(False, description="Send the judge's API key over plain http to a host other "
                                      "than this machine (by default it goes only to https or loopback URLs).")

    @field_validator("reward", "tool", mode="before")
    @classmethod
    def _split_specs(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if callable(value):
            return [value]
        return value

    @field_validator("reward_weights", mode="before")
    @classmethod
    def _split_weights(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.strip("[]").split(",") if part.strip()]
        if isinstance(value, (int, float)):
            return [value]
        return value


class DatasetEnvironment(Environment):
    name = "dataset"
    description = "Any dataset (file or Hugging Face id) with TRL-style reward functions: -o data=... -o reward=module:fn"
    splits = ("train", "test")
    # Suggested for a pretrained (instruct) model, the usual case here: the ES paper's population and σ,
    # TRL's GRPO group size, learning rate and completion length. The tiny model needs larger steps.
    defaults = {
        "sampling.max_new_tokens": 256,
        "es.population_size": 30,
        "es.sigma": 1e-3,
        "grpo.num_generations": 8,
        "grpo.learning_rate": 1e-6,
    }
    Options = DatasetOptions

    def __init__(self, **options: Any):
        """Options: see `DatasetOptions`. The reward functions are imported here, the data on first use."""
        o = self.parse_options(options)
        self.options = o
        self.tools = [load_reward_function(t, "tool") if isinstance(t, str) else t for t in o.tool]
        factories = o.environment_factory
        self.routed = isinstance(factories, dict)  # several environments: each row names its own (TRL's dict)
        if self.routed and not factories:
            raise OptionsError("environment 'dataset': environment_factory is an empty dict; name at least one "
                               "environment (-o environment_factory.NAME=module:Class)")
        self.factories: dict[str | None, Any] = {} if factories is None else {
            name: load_reward_function(f, "environment_factory") if isinstance(f, str) else f
            for name, f in (factories.items() if self.routed else [(None, factories)])}
        self.factory = None if self.routed else self.factories.get(None)  # the one factory (None: none, or a dict)
        # Each factory's class, checked for `reset` here (as TRL probes at construction); a factory that is not a
        # class is called once to see its instances' class, and that instance is its pool's first.
        self._classes: dict[str | None, type] = {}
        self._probes: dict[str | None, Any] = {}
        for name, factory in self.factories.items():
            self._classes[name] = self._environment_class(name, factory)
        self._pools: dict[str | None, InstancePool] = {}
        if o.data is None and self.routed:  # as TRL refuses a missing train_dataset
            raise OptionsError("environment 'dataset': a dict environment_factory needs data whose 'environment' "
                               "column routes each row (-o data=FILE); without data, give one environment_factory class")
        if o.data is None and self.factory is None:
            raise OptionsError("environment 'dataset': no data; give -o data=FILE (or a Hugging Face id), or one "
                               "environment_factory class whose reset() gives each prompt (TRL's training without a "
                               "dataset)")
        if o.max_tool_calling_iterations is not None:
            if "max_turns" in o.model_fields_set:
                raise OptionsError("environment 'dataset': give max_turns or max_tool_calling_iterations (TRL's name, "
                                   "max_turns - 1), not both")
            self.max_turns = o.max_tool_calling_iterations + 1
        else:
            self.max_turns = o.max_turns
        rewards, weights = [_model_reward(r, o) for r in o.reward], o.reward_weights
        owners: list[type] = []  # the classes that own a reward (get_reward), once each, as TRL adds them
        for cls in self._classes.values():
            if callable(getattr(cls, "get_reward", None)) and cls not in owners:
                owners.append(cls)
        for cls in owners:  # the environment owns a reward (TRL: weight 1, named after the class)
            names = [n for n, c in self._classes.items() if c is cls] if self.routed else None
            rewards.append(environment_reward(cls, names))
            weights = None if weights is None else [*weights, 1.0]
        judge_set = sorted(f for f in o.model_fields_set if f.startswith("judge_"))
        if judge_set and not any(isinstance(r, str) and r.startswith("judge:") for r in o.reward):
            raise OptionsError(f"environment 'dataset': {', '.join(judge_set)} set a judge: reward, and there is none "
                               "(-o reward=judge:MODEL@BASE_URL)")
        if not rewards:
            raise OptionsError("environment 'dataset': give a reward function (-o reward=module:function) or an "
                               "environment_factory whose class has get_reward")
        for tool in self.tools:
            schema(tool)  # a tool without types or a docstring is refused here, before anything loads
        schemas = None
        if self.multi_turn:  # every environment's tools (a routed row is offered its own environment's only)
            schemas = tool_schemas(self.tools)
            for cls in self._classes.values():
                schemas.update(tool_schemas((), cls))
        self.rewards = RewardFunctions(rewards, weights, timeout_s=o.reward_timeout_s,
                                       pass_threshold=o.pass_threshold, tools=schemas)
        self._tasks: dict[str, list[Task]] = {}
        self._one_file = o.data is None or Path(o.data).expanduser().is_file()
        if self._one_file:  # a file is one split (`vrl verify` looks for task ids in every split)
            self.splits = ("train",)

    # -- tasks -------------------------------------------------------------------------------------
    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        if self._one_file and split == "test":
            raise UnknownSplitError(f"{self.options.data or 'no data (placeholder rows)'} is one split, 'train'; there "
                                    "is no split 'test' (evaluate on it with `vrl eval --split train`)")
        self._check_split(split)
        if split not in self._tasks and self.options.data is None:  # the environment owns the data (TRL's
            self.rewards.check_columns([], "training without data", environments=True)  # dataset-less training)
            self._tasks[split] = placeholder_tasks(self.options.system_prompt, PLACEHOLDER_ROWS)
            self._check_resets(self._tasks[split][:1], "training without data")
        if split not in self._tasks:
            name = self.options.split if split == "train" else self.options.test_split
            source, rows = load_rows(self.options.data, name, self.options.subset)
            tasks = rows_to_tasks(rows, source, name, self.options.prompt_column, self.options.system_prompt,
                                  self.options.id_column, prompt_optional=bool(self.factories),
                                  environments=[str(n) for n in self.factories] if self.routed else None)
            self.rewards.check_columns(sorted({k for t in tasks for k in t.data}), source,
                                       environments=bool(self.factories))
            self._check_resets(tasks, source)
            self._tasks[split] = tasks
        tasks = self._tasks[split]
        return tasks if limit is None else tasks[:limit]

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or bool(self.factories)

    def _environment_class(self, name: str | None, factory: Any) -> type:
        """The class of `factory`'s instances, refused in one line without `reset` (TRL's check at construction)."""
        label = "environment_factory" + ("" if name is None else f".{name}")
        if not callable(factory):
            raise OptionsError(f"environment 'dataset': {label} must be a class (module:Class), got "
                               f"{type(factory).__name__}")
        if isinstance(factory, type):
            cls = factory
        else:  # a function making instances: one is made now (and kept, the first of its pool)
            self._probes[name] = factory()
            cls = type(self._probes[name])
        if not callable(getattr(cls, "reset", None)):
            raise OptionsError(f"environment 'dataset': {label} {cls.__name__} has no reset method; a TRL environment "
                               "class defines reset(**row), called before each episode (it returns None, or text "
                               "appended to the prompt)")
        return cls

    def _reset_row(self, task: Task) -> dict[str, Any]:
        """The keywords `reset` gets for `task`, as TRL passes a row: its columns (with the prompt, unless the row had
        none; TRL's placeholder prompt without data), without a dict factory's `environment` column."""
        o = self.options
        if o.data is None:  # TRL's dataset-less rows hold the placeholder prompt, which reset(**row) gets
            row = {"prompt": task.prompt, **task.data}
        else:  # a row without the prompt column gets reset(**row) without it, as in TRL
            row = dict(task.data) if is_placeholder(task.prompt) else {o.prompt_column: task.prompt, **task.data}
        if self.routed:
            row.pop(ENVIRONMENT_COLUMN, None)  # a control column, not reset's (as TRL)
        return row

    def _check_resets(self, tasks: Sequence[Task], source: str) -> None:
        """Refuse, before anything loads, an environment class whose `reset` cannot take the rows' columns (TRL calls
        `reset(**row)`, which would raise at the first episode): one line naming the class, a row and the fix."""
        seen: set[tuple[str | None, tuple[str, ...]]] = set()
        for task in tasks if self._classes else ():
            name = task.data.get(ENVIRONMENT_COLUMN) if self.routed else None
            keys = tuple(sorted(self._reset_row(task)))
            if (name, keys) in seen or name not in self._classes:
                continue
            seen.add((name, keys))
            cls = self._classes[name]
            try:
                signature = inspect.signature(cls.reset)
            except (TypeError, ValueError):  # a builtin or C method: nothing to check
                continue
            bound = isinstance(inspect.getattr_static(cls, "reset", None), (staticmethod, classmethod))
            try:
                signature.bind(**dict.fromkeys(keys)) if bound else signature.bind(None, **dict.fromkeys(keys))
            except TypeError as exc:
                raise OptionsError(f"environment 'dataset': {cls.__name__}.reset cannot take the row of task {task.id!r} "
                                   f"({source}; its columns: {', '.join(keys) or 'none'}): {exc}; TRL calls reset(**row), "
                                   "so give it **kwargs (def reset(self, **kwargs))") from None

    def _instance(self, name: str | None) -> Any:
        """A free instance of environment `name` from its pool (made only when none is free)."""
        if name not in self._pools:
            self._pools[name] = InstancePool(self.factories[name], self._probes.pop(name, None))
        return self._pools[name].take()

    def interaction(self, task: Task) -> ToolInteraction | None:
        """With tools or an environment class: an episode with tools (an environment instance from the pool,
        reset with the task's row; a routed row's own environment); else None, one turn."""
        if not self.multi_turn:
            return None
        o = self.options
        row = self._reset_row(task)
        name = None
        if self.routed:
            name = task.data.get(ENVIRONMENT_COLUMN)
            if name not in self.factories:
                raise MalformedDataset(f"task {task.id!r}: environment {name!r} is not one of environment_factory's "
                                       f"({', '.join(map(str, self.factories))})")
        instance = self._instance(name) if self.factories else None
        return ToolInteraction(self.tools, instance, max_turns=self.max_turns, timeout_s=o.tool_timeout_s,
                               row=row, feedback=o.tool_feedback, max_tokens=o.max_completion_length,
                               step_timeout_s=o.step_timeout_s)

    def configure(self, config: Any) -> None:
        self.rewards.set_chat_template_kwargs(config.sampling.chat_template_kwargs)  # a reward model's chats (TRL)

    def begin_iteration(self, iteration: int, iterations: int) -> None:
        self.rewards.begin_iteration(iteration, iterations)  # TRL's trainer_state

    def verifier(self) -> RewardFunctionVerifier:
        return self.rewards.verifier()

    def shaper(self) -> RewardFunctionShaper:
        return self.rewards.shaper()

    def iteration_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return self.rewards.iteration_metrics(sums)

    def modal_sandbox(self) -> None:
        # A plain sandbox image has neither the user's data file nor the module of their reward functions.
        raise UsageError("the dataset environment runs its reward functions in the orchestrator on Modal: "
                         "set --set runtime.modal.verify_in=local")


def _model_reward(reward: Any, o: DatasetOptions) -> Any:
    """A `model:` or `judge:` spec built with the judge_* options (`vrl.reward_models`); anything else as it is."""
    from vrl.reward_models import JUDGE_PREFIX, JUDGE_SETTINGS, MODEL_PREFIX, reward_from_spec

    if not isinstance(reward, str) or not reward.startswith((MODEL_PREFIX, JUDGE_PREFIX)):
        return reward
    settings = {k: getattr(o, f"judge_{k}") for k in JUDGE_SETTINGS if f"judge_{k}" in o.model_fields_set}
    return reward_from_spec(reward, judge=settings)


def environment_reward(factory: Any, names: Sequence[str | None] | None = None) -> Callable[..., list[float | None]]:
    """The reward function of an environment class with `get_reward`: each episode's value, computed by its own
    instance when the episode ended (`Episode.reward`), logged under the class's name as TRL does. `names`: with a
    dict environment_factory, the environments of this class; another environment's rows get None (not applicable)."""

    def reward(environment_rewards: list[float | None], **kwargs: Any) -> list[float | None]:
        if names is None:
            return list(environment_rewards)
        routed = kwargs.get(ENVIRONMENT_COLUMN) or [None] * len(environment_rewards)
        return [r if n in names else None for r, n in zip(environment_rewards, routed)]

    reward.__name__ = getattr(factory, "__name__", "environment")
    return reward


# -- loading -------------------------------------------------------------------------------------------
Row = tuple[str, Any]  # (where, for messages: "data.jsonl:3"; the row as read)


def load_rows(data: str, split: str, subset: str | None = None) -> tuple[str, list[Row]]:
    """(a name for messages, the rows of `split`) from a local file or a Hugging Face dataset."""
    path = Path(data).expanduser()
    if path.is_file():
        if split != "train":
            raise UnknownSplitError(f"{data} is one split, 'train'; there is no split {split!r} (-o split=train)")
        return str(path), read_file(path)
    if not path.is_dir() and (path.suffix.lower() in FILE_SUFFIXES or data.startswith((".", "/", "~"))):
        raise DatasetUnavailable(f"dataset file not found: {data}")
    return hub_rows(data, split, subset)


def read_file(path: Path) -> list[Row]:
    """Rows of a .jsonl, .json (a list of objects), .csv or .parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetUnavailable(f"reading {path} needs pyarrow: pip install pyarrow") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors vary; each means the file is unreadable
            raise MalformedDataset(f"{path}: not a readable Parquet file ({exc})") from None
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedDataset(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        rows = []
        for row in reader:
            if None in row or None in row.values():  # more or fewer cells than the header has
                raise MalformedDataset(f"{path}:{reader.line_num}: {len(reader.fieldnames or [])} columns in the header, "
                                       "a different number in this row")
            rows.append((f"{path}:{reader.line_num}", row))
        return rows
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedDataset(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise MalformedDataset(f"{path} must hold a JSON list of row objects, not a {type(data).__name__} "
                                   "(or use JSON Lines, one object per line, as .jsonl)")
        return [(f"{path} item {i + 1}", row) for i, row in enumerate(data)]
    if suffix != ".jsonl":
        raise DatasetUnavailable(f"{path}: unknown file type {path.suffix!r}; use {', '.join(FILE_SUFFIXES)}")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise MalformedDataset(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
    return rows


def hub_rows(name: str, split: str, subset: str | None = None) -> tuple[str, list[Row]]:
    """One split of a Hugging Face dataset (or a local dataset directory), through `datasets`."""
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailable(f"loading {name!r} from the Hugging Face Hub needs the `datasets` package: "
                                 "pip install datasets (or give a local .jsonl/.json/.csv/.parquet file)") from None
    label = f"{name}{':' + subset if subset else ''}"
    try:
        available = list(datasets.get_dataset_split_names(name, subset))
    except Exception as exc:  # noqa: BLE001 - offline, unknown name, gated: all worth the same advice
        raise DatasetUnavailable(f"could not load dataset {label!r} from the Hugging Face Hub "
                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); check the id, "
                                 "log in for a gated one, or download it and give the file") from None
    if split not in available:
        raise UnknownSplitError(f"dataset {label!r} has no split {split!r}; its splits: {', '.join(available)}; "
                                "-o split=NAME picks the one to train on, -o test_split=NAME the one `vrl eval` uses")
    try:
        loaded = datasets.load_dataset(name, subset, split=split)
    except Exception as exc:  # noqa: BLE001
        raise DatasetUnavailable(f"could not load split {split!r} of dataset {label!r} "
                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    return f"{label}/{split}", [(f"{label}/{split} row {i + 1}", dict(row)) for i, row in enumerate(loaded)]


def rows_to_tasks(rows: Sequence[Row], source: str, split: str, prompt_column: str, system_prompt: str | None = None,
                  id_column: str | None = None, prompt_optional: bool = False,
                  environments: Sequence[str] | None = None) -> list[Task]:
    """One task per row: the prompt from `prompt_column`, every other column in `Task.data`.

    A row that is not an object, lacks the prompt (or id) column, has an empty or ill-formed prompt,
    repeats an id or has a column named like a reward function argument is a `MalformedDataset`
    naming it; a source without rows is an error too. `prompt_optional` (an environment class's `reset` supplies
    the prompt): a row without the prompt column gets TRL's placeholder, one empty user message. `environments`
    (a dict environment_factory): every row names one of them in its `environment` column.
    """
    if not rows:
        raise MalformedDataset(f"{source} has no rows")
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise MalformedDataset(f"{where}: a row must be an object with named columns, not a {type(row).__name__}")
        if prompt_column in row:
            prompt = _prompt(row[prompt_column], where, prompt_column, system_prompt)
        elif prompt_optional:  # the environment's reset() supplies the prompt (TRL's placeholder, as TRL builds it)
            prompt = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + \
                [dict(PLACEHOLDER)]
        else:
            raise MalformedDataset(f"{where}: no column {prompt_column!r} (its columns: {', '.join(map(str, row))}); "
                                   "name the prompt column with -o prompt_column=NAME")
        if environments is not None and row.get(ENVIRONMENT_COLUMN) not in environments:
            raise MalformedDataset(f"{where}: the {ENVIRONMENT_COLUMN!r} column must name one of environment_factory's "
                                   f"environments ({', '.join(environments)}), got {row.get(ENVIRONMENT_COLUMN)!r}")
        if id_column is not None:
            if row.get(id_column) in (None, ""):
                raise MalformedDataset(f"{where}: no value in the id column {id_column!r}")
            task_id = str(row[id_column])
        else:
            task_id = f"{split}-{index}"
        if task_id in seen:
            raise MalformedDataset(f"{where}: task id {task_id!r} repeats {seen[task_id]}; ids must be unique")
        seen[task_id] = where
        data = {str(k): v for k, v in row.items() if k != prompt_column}
        clash = [k for k in data if k in RESERVED]
        if clash:
            raise MalformedDataset(f"{where}: column {clash[0]!r} has the name of a reward function argument "
                                   f"({', '.join(RESERVED)}); rename it")
        tasks.append(Task(id=task_id, prompt=prompt, data=data))
    return tasks


def placeholder_tasks(system_prompt: str | None, count: int) -> list[Task]:
    """Training without data (TRL's dataset-less `environment_factory`): `count` rows of TRL's placeholder prompt,
    one empty user message (after the system prompt, if any), which each episode's reset() completes."""
    prompt = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [dict(PLACEHOLDER)]
    return [Task(id=f"train-{i}", prompt=prompt) for i in range(count)]


def is_placeholder(prompt: Any) -> bool:
    """Whether `prompt` is the placeholder of a row without a prompt (its environment's reset() supplies it)."""
    return isinstance(prompt, list) and bool(prompt) and prompt[-1] == PLACEHOLDER


def _prompt(value: Any, where: str, column: str, system_prompt: str | None) -> str | list[dict[str, str]]:
    """Text or chat messages, with the system prompt in front (a text prompt then becomes messages)."""
    if isinstance(value, str):
        if not value.strip():
            raise MalformedDataset(f"{where}: the prompt column {column!r} is empty")
        if system_prompt is None:
            return value
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": value}]
    if isinstance(value, list) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise MalformedDataset(f"{where}: message {i + 1} of {column!r} must be an object with string 'role' "
                                       f"and 'content', got {json.dumps(m, default=str)[:80]}")
            messages.append({"role": m["role"], "content": m["content"]})
        if system_prompt is not None:
            if messages[0]["role"] == "system":
                raise MalformedDataset(f"{where}: the prompt has its own system message and -o system_prompt gives "
                                       "another; drop one of them")
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    raise MalformedDataset(f"{where}: the prompt column {column!r} must hold text or a non-empty list of chat "
                           f"messages, got {json.dumps(value, default=str)[:80]}")
