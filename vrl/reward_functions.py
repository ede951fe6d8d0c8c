"""Reward functions in TRL's shape, judged like any verifier and logged one by one.

A reward function takes a batch and returns one reward per completion::

    def accuracy(prompts, completions, answer, **kwargs) -> list[float | None]: ...
    async def judge(prompts, completions, **kwargs) -> list[float | None]: ...

`prompts` and `completions` are lists (a prompt as the model saw it: an environment class's `reset()` text
appended, as TRL 1.16 passes it; a completion is a string, or `[{"role": "assistant",
"content": ...}]` when the prompt is chat messages, as in TRL; with tools, an episode's messages in TRL's
parsed form: `reasoning_content`, structured `tool_calls`, then the tool messages); `completion_ids` holds
the sampled token ids; every field of `Task.data` (the dataset's other columns) comes as a keyword list.
As TRL 1.16 passes them: `environments` (each episode's environment instance, in order), `trainer_state`
(a `transformers.TrainerState`: `global_step` is the updates before the batch was sampled, `max_steps` the
run's iterations), `log_extra(column, values)` (one value per completion, shown in the sample's verdict
detail) and `log_metric(name, value)` (averaged per iteration into metrics.jsonl under `name`). vrl adds
`raw_completions`: each completion as decoded, unparsed. None means "does not apply to this completion"
and is left out of the weighted sum (TRL's convention); an exception instance in place of a value fails that
completion alone (an LLM judge's completion it could not score), the others keep their values.

`RewardFunctions` bundles functions with their weights and gives an environment its verifier,
its shaper and its per-function metrics. A sync function runs in a thread of its own, an async one
on one event loop shared by every call (as TRL does); each call is bounded by `timeout_s`: a batch whose call raises, hangs or answers malformed is retried one completion at a
time, so a completion that breaks a function costs that completion alone. Such a failure is the
verifier's own error (`vrl.verifier.verifier_error`): the trainer stops a run whose function fails
on (nearly) everything, and keeps going past a few bad rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vrl.errors import UsageError, describe
from vrl.reward import RewardShaper
from vrl.types import Attempt, Completion, Status, Task, Verdict
from vrl.verifier import Verifier, verifier_error

log = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]
"""`fn(prompts, completions, **columns) -> list[float | None]`, or a coroutine function returning that."""

#: Keyword arguments vrl passes besides the task's data columns (which must not reuse these names).
RESERVED = ("prompts", "completions", "completion_ids", "environment_rewards", "environments", "trainer_state",
            "log_extra", "log_metric", "raw_completions")
#: Those TRL passes to every call whatever the batch (`environments` only where episodes keep instances).
ALWAYS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "raw_completions",
          "environment_rewards")
PREFIX = "reward/"
METRIC = "log_metric/"  # a verdict's share of what reward functions logged with `log_metric`
_LOST = "\0lost"  # batch_arguments' own list (never passed on): episodes whose environment instance is not here


class RewardFunctionError(UsageError, ValueError):
    """A reward function that cannot be found, imported or called as declared."""


def reward_name(fn: RewardFunction) -> str:
    """The name a function is logged under (`reward/<name>/mean`): its `__name__`, a partial's
    function's, or a callable object's class name, as TRL names them."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", None) or type(target).__name__
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "reward"


def load_reward_function(spec: str, kind: str = "reward") -> RewardFunction:
    """`module:function` (an importable module, or a module file in the working directory),
    `path/to/file.py:function`, or, for a reward, `model:PATH_OR_ID` (a reward model) or
    `judge:MODEL@BASE_URL` (an LLM judge; `vrl.reward_models`); a one-line `RewardFunctionError` says what
    is missing. `kind`: the option it came from, for the messages (`reward`, `tool`, `environment_factory`)."""
    if kind == "reward" and spec.startswith(("model:", "judge:")):
        from vrl.reward_models import reward_from_spec  # here: it is the only user of transformers' classifiers

        return reward_from_spec(spec)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        what = "Class" if kind == "environment_factory" else "function"
        raise RewardFunctionError(f"{kind} {spec!r} must look like module:{what} or path/to/file.py:{what}")
    path = Path(where) if where.endswith(".py") else Path(*where.split(".")).with_suffix(".py")
    try:
        if where.endswith(".py") or (importlib.util.find_spec(where.split(".")[0]) is None and path.is_file()):
            module = _module_from_file(path)
        else:
            module = importlib.import_module(where)
    except RewardFunctionError:
        raise
    except ModuleNotFoundError as exc:
        raise RewardFunctionError(f"{kind} {spec!r}: no module named {exc.name!r} (give a module on the Python path, "
                                  f"or the file: -o {kind}=path/to/file.py:{attr})") from None
    except Exception as exc:  # the user's module fails to import: say where
        raise RewardFunctionError(f"{kind} {spec!r}: importing it raised {describe(exc)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardFunctionError(f"{kind} {spec!r}: {where} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardFunctionError(f"{kind} {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def _module_from_file(path: Path) -> Any:
    if not path.is_file():
        raise RewardFunctionError(f"reward file not found: {path}")
    name = f"vrl_rewards_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@dataclass(frozen=True)
class _Failure:
    reason: str


@dataclass
class _Log:
    """What one call logged through `log_metric` and `log_extra` (kept only when the call succeeds)."""

    metrics: list[tuple[str, float]] = field(default_factory=list)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def metric(self, name: str, value: float) -> None:
        self.metrics.append((str(name), float(value)))

    def column(self, column: str, values: list[Any]) -> None:
        self.extra.setdefault(str(column), []).extend(list(values))


class RewardFunctions:
    """Named reward functions with weights: an environment's verifier, shaper and per-function metrics.

    The reward of a completion is Σ weightᵢ·rewardᵢ over the functions that returned a number for it
    (None: not applicable). It passes when that sum reaches `pass_threshold`. Use it in any
    environment whose tasks carry, in `Task.data`, the columns its functions read::

        rewards = RewardFunctions([accuracy, brevity], weights=[1.0, 0.2])
        class MyEnv(vrl.Environment):
            def verifier(self): return rewards.verifier()
            def shaper(self): return rewards.shaper()
            def iteration_metrics(self, sums): return rewards.iteration_metrics(sums)
    """

    def __init__(self, functions: Sequence[RewardFunction | str], weights: Sequence[float] | None = None,
                 timeout_s: float = 60.0, pass_threshold: float = 1.0,
                 tools: dict[str, dict[str, Any]] | None = None):
        """`tools`: the schemas (by name) of the tools the episodes offer; with them, an episode's completion
        reaches the functions in TRL's parsed form (`vrl.tools.parse_message`), its arguments typed by them."""
        loaded = [load_reward_function(f) if isinstance(f, str) else _model_function(f) for f in functions]
        if not loaded:
            raise RewardFunctionError("give at least one reward function")
        for fn in loaded:
            if not callable(fn):
                raise RewardFunctionError(f"a reward function must be callable, got {type(fn).__name__}")
        weights = [1.0] * len(loaded) if weights is None else [float(w) for w in weights]
        if len(weights) != len(loaded):
            raise RewardFunctionError(f"{len(weights)} reward weights for {len(loaded)} reward functions; "
                                      "give one weight per function")
        if not all(math.isfinite(w) for w in weights):
            raise RewardFunctionError(f"reward weights must be finite numbers, got {weights}")
        if not timeout_s > 0:
            raise RewardFunctionError(f"timeout_s must be positive, got {timeout_s}")
        for fn in loaded:  # a function that bounds its own calls (an LLM judge) is told the cap, and may refuse it
            if callable(getattr(fn, "set_call_timeout", None)):
                fn.set_call_timeout(float(timeout_s))
        self.functions = loaded
        self.weights = weights
        self.names = _unique([reward_name(f) for f in loaded])
        self.timeout_s = float(timeout_s)
        self.pass_threshold = float(pass_threshold)
        self.tools = dict(tools) if tools else None
        self.iteration, self.iterations = 0, 0  # `begin_iteration`: TRL's trainer_state.global_step, max_steps

    def __repr__(self) -> str:
        terms = ", ".join(f"{n}×{w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardFunctions({terms})"

    def set_chat_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """The run's `sampling.chat_template_kwargs`, handed to each function that renders chats itself (a reward
        model, `set_chat_template_kwargs`), as TRL renders a reward model's input with its `chat_template_kwargs`."""
        for fn in self.functions:
            if callable(getattr(fn, "set_chat_template_kwargs", None)):
                fn.set_chat_template_kwargs(dict(kwargs))

    def begin_iteration(self, iteration: int, iterations: int) -> None:
        """The run is at `iteration` (0-based) of `iterations`: what `trainer_state` says to the functions."""
        self.iteration, self.iterations = int(iteration), int(iterations)

    def trainer_state(self, attempts: Sequence[Attempt]) -> Any:
        """TRL's `trainer_state` for a batch: a `transformers.TrainerState` whose `global_step` is the updates made
        before the batch was sampled (its `weights_version` when sampled ahead, else the iteration) and
        `max_steps` the run's iterations."""
        from transformers import TrainerState

        versions = [a.completion.weights_version for a in attempts if a.completion.weights_version is not None]
        return TrainerState(global_step=min(versions) if versions else self.iteration, max_steps=self.iterations)

    def check_columns(self, columns: Sequence[str], source: str, environments: bool = False) -> None:
        """Refuse, before any generation, a function that needs a column `source` does not have (or the
        `environments` of episodes that keep none: `environments=False`)."""
        available = set(ALWAYS) | set(columns) | ({"environments"} if environments else set())
        for name, fn in zip(self.names, self.functions):
            needed = _required(fn)
            if "environments" in needed and not environments:
                raise RewardFunctionError(f"reward function {name!r} needs 'environments', the environment instances "
                                          "of episodes, which only an environment_factory class gives (-o "
                                          "environment_factory=module:Class)")
            missing = [p for p in needed if p not in available]
            if missing:
                raise RewardFunctionError(f"reward function {name!r} needs {', '.join(map(repr, missing))}, which {source} "
                                          f"does not have (its columns: {', '.join(columns) or 'none'})")

    def total(self, values: Sequence[float | None]) -> float | None:
        """Σ weightᵢ·valueᵢ over the values that are not None; None when every one is."""
        present = [(w, v) for w, v in zip(self.weights, values) if v is not None]
        return sum(w * v for w, v in present) if present else None

    def verifier(self) -> RewardFunctionVerifier:
        return RewardFunctionVerifier(self)

    def shaper(self) -> RewardFunctionShaper:
        return RewardFunctionShaper(self)

    def iteration_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """`reward/<name>/mean` and `/std` over the completions each function applied to (TRL's
        `rewards/<name>/mean`), from the per-completion values the verifier put in `Verdict.metrics`;
        other counters pass through."""
        out = {k: v for k, v in sums.items() if not k.startswith((PREFIX, METRIC))}
        for key, total in sums.items():  # log_metric: the mean of what the calls of the iteration logged (as TRL)
            if key.startswith(METRIC) and not key.endswith("/n") and sums.get(f"{key}/n"):
                out[key[len(METRIC):]] = total / sums[f"{key}/n"]
        for name in self.names:
            key = PREFIX + name
            n = sums.get(f"{key}/n", 0.0)
            if n:
                mean = sums.get(key, 0.0) / n
                out[f"{key}/mean"] = mean
                out[f"{key}/std"] = math.sqrt(max(0.0, sums.get(f"{key}/sq", 0.0) / n - mean * mean))
            out[f"{key}/applied"] = n
        return out


def _model_function(fn: Any) -> Any:
    """A loaded sequence-classification model (TRL's `reward_funcs=[model]`) as a `RewardModel`; else `fn`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(fn, torch.nn.Module):
        from vrl.reward_models import RewardModel

        return RewardModel.from_model(fn)
    return fn


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def _required(fn: RewardFunction) -> list[str]:
    """Parameters a call must supply (no default, not *args/**kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _named(fn: RewardFunction) -> set[str]:
    """The parameters a function names (whether or not it also takes **kwargs)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _accepted(fn: RewardFunction) -> set[str] | None:
    """The keyword names a function takes; None when it takes **kwargs (everything is passed, as TRL does)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def batch_arguments(attempts: Sequence[Attempt], tools: dict[str, dict[str, Any]] | None = None) -> dict[str, list[Any]]:
    """The keyword lists a reward function receives for a batch (TRL's layout); `tools`: the episodes' tool
    schemas, with which an episode's completion is in TRL's parsed form (`raw_completions` keeps it unparsed)."""
    from vrl.episodes import environment_of

    # TRL's `prompts`: each episode's first prompt as the model saw it (its environment's reset() text appended)
    prompts = [a.completion.episode.prompt if a.completion.episode is not None and a.completion.episode.prompt is not None
               else a.task.prompt for a in attempts]
    kwargs: dict[str, list[Any]] = {"prompts": prompts,
                                    "completions": [_completion(a.task, a.completion, tools) for a in attempts],
                                    "completion_ids": [a.completion.token_ids for a in attempts],
                                    "raw_completions": [_completion(a.task, a.completion) for a in attempts]}
    if any(a.completion.episode is not None for a in attempts):  # what each episode's environment scored (get_reward)
        kwargs["environment_rewards"] = [a.completion.episode.reward if a.completion.episode else None for a in attempts]
        instances = [environment_of(a.completion) for a in attempts]
        if any(i is not None for i in instances):  # TRL's `environments`: one instance per completion, in order
            kwargs["environments"] = instances
        # episodes without their instance here (sampled in another process): a function reading them is told so
        kwargs[_LOST] = [a.completion.episode is not None and i is None for a, i in zip(attempts, instances)]
    columns: list[str] = []
    for a in attempts:
        columns += [k for k in a.task.data if k not in columns]
    for column in columns:
        if column in RESERVED:
            raise RewardFunctionError(f"task {attempts[0].task.id!r} has a data column named {column!r}, which clashes "
                                      f"with the argument of that name; rename the column")
        kwargs[column] = [a.task.data.get(column) for a in attempts]
    return kwargs


def _completion(task: Task, completion: Completion, tools: dict[str, dict[str, Any]] | None = None) -> Any:
    if isinstance(task.prompt, str):
        return completion.text
    if completion.episode is not None:  # an episode: every turn after the prompt, tool results included (as TRL)
        if tools:  # TRL's parsed assistant messages (it parses only where tools are in play)
            from vrl.tools import parse_message

            return [parse_message(t.content, tools) if t.role == "assistant" else
                    {"role": t.role, "content": t.content, **({"name": t.name} if t.name else {})}
                    for t in completion.episode.turns]
        return [{"role": t.role, "content": t.content, **({"name": t.name} if t.name else {})}
                for t in completion.episode.turns]
    return [{"role": "assistant", "content": completion.text}]


def _start(fn: RewardFunction, kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:
    """Start a call: an async function on the process's reward event loop (one loop for every call,
    as TRL runs them, so a client an async function keeps stays on its loop); a sync one in a daemon
    thread of its own, so a hang keeps that thread, never the verifier's loop or the process's exit."""
    if _is_async(fn):
        return asyncio.run_coroutine_threadsafe(_call_async(fn, kwargs), _reward_loop())
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            result = fn(**kwargs)
            if inspect.isawaitable(result):  # a sync callable that returns a coroutine
                result = asyncio.run_coroutine_threadsafe(_awaited(result), _reward_loop()).result()
        except BaseException as exc:  # handed to the caller, which turns it into verdicts
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=work, name=f"vrl-reward-{reward_name(fn)}", daemon=True).start()
    return future


def _is_async(fn: RewardFunction) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) and not isinstance(fn, functools.partial) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


async def _call_async(fn: RewardFunction, kwargs: dict[str, Any]) -> Any:
    return await fn(**kwargs)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on: one per process, in a daemon thread, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="vrl-async-rewards", daemon=True).start()
        return _loop


class RewardFunctionVerifier(Verifier):
    """Calls each reward function on the batch (concurrently, each bounded by `timeout_s`) and turns
    the values into verdicts; see `RewardFunctions`."""

    name = "reward-functions"

    def __init__(self, rewards: RewardFunctions):
        self.rewards = rewards
        self._warned: set[str] = set()  # functions whose hang was logged (once each)

    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        start = time.perf_counter()
        kwargs = batch_arguments(attempts, self.rewards.tools)
        state = self.rewards.trainer_state(attempts)
        logs: list[tuple[list[int], _Log]] = []
        columns = await asyncio.gather(*(self._values(fn, name, attempts, kwargs, state, logs)
                                         for fn, name in zip(self.rewards.functions, self.rewards.names)))
        elapsed = (time.perf_counter() - start) / max(1, len(attempts))
        verdicts = [self._verdict([c[i] for c in columns], elapsed) for i in range(len(attempts))]
        return _with_logs(verdicts, logs)

    async def _values(self, fn: RewardFunction, name: str, attempts: Sequence[Attempt], kwargs: dict[str, list[Any]],
                      state: Any, logs: list[tuple[list[int], _Log]]) -> list[float | None | _Failure]:
        """One value (or failure) per attempt; a batch that fails as a whole is retried one attempt at a time.
        What a successful call logged is added to `logs`, with the attempts it covers."""
        log = _Log()
        values = await self._call(fn, name, kwargs, len(attempts), state, log)
        if not isinstance(values, _Failure):
            logs.append((list(range(len(attempts))), log))
            return values
        if len(attempts) == 1:
            return [values]
        singles_logs = [_Log() for _ in attempts]
        singles = await asyncio.gather(*(self._call(fn, name, {k: [v[i]] for k, v in kwargs.items()}, 1, state,
                                                    singles_logs[i]) for i in range(len(attempts))))
        logs += [([i], singles_logs[i]) for i, s in enumerate(singles) if not isinstance(s, _Failure)]
        return [s if isinstance(s, _Failure) else s[0] for s in singles]

    async def _call(self, fn: RewardFunction, name: str, kwargs: dict[str, list[Any]], n: int, state: Any = None,
                    logged: _Log | None = None) -> list[float | None | _Failure] | _Failure:
        logged = logged if logged is not None else _Log()
        accepted = _accepted(fn)
        lost = any(kwargs.get(_LOST, ()))
        kwargs = {k: v for k, v in kwargs.items() if k != _LOST}
        kwargs.update(trainer_state=state, log_extra=logged.column, log_metric=logged.metric)
        args = kwargs if accepted is None else {k: v for k, v in kwargs.items() if k in accepted}
        if lost and "environments" in (accepted if accepted is not None else _named(fn)):
            return _Failure(f"reward function {name!r} reads 'environments', but an episode's environment instance "
                            "stayed in the process that sampled it (an instance cannot cross processes: run the "
                            "engine in this process, or read what get_reward returned through environment_rewards)")
        timeout = self.rewards.timeout_s
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(_start(fn, args)), timeout)
        except asyncio.TimeoutError:
            if name not in self._warned:
                self._warned.add(name)
                left = "its coroutine was cancelled" if _is_async(fn) else "its thread cannot be stopped and is left running"
                log.warning("reward function %r did not return within %g s (reward_timeout_s): %s, and the completions "
                            "it was judging fail; later overruns count in the verdicts only", name, timeout, left)
            return _Failure(f"reward function {name!r} did not return within {timeout:g} s")
        except Exception as exc:
            return _Failure(f"reward function {name!r} raised {describe(exc)}")
        try:
            values = list(result.tolist() if hasattr(result, "tolist") else result)
        except TypeError:
            return _Failure(f"reward function {name!r} returned a {type(result).__name__}, not a list of rewards")
        if len(values) != n:
            return _Failure(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
        return [_value(v, name) for v in values]

    def _verdict(self, values: list[float | None | _Failure], elapsed_s: float) -> Verdict:
        metrics: dict[str, float] = {}
        shown = []
        for name, v in zip(self.rewards.names, values):
            if isinstance(v, float):
                key = PREFIX + name
                metrics.update({key: v, f"{key}/n": 1.0, f"{key}/sq": v * v})
            shown.append(f"{name}={'n/a' if v is None else 'error' if isinstance(v, _Failure) else f'{v:.4g}'}")
        failures = [v for v in values if isinstance(v, _Failure)]
        if failures:
            verdict = verifier_error(failures[0].reason, elapsed_s=elapsed_s)
        else:
            total = self.rewards.total(values)  # type: ignore[arg-type]
            if total is None:
                verdict = Verdict.fail(Status.REJECTED, "no reward function applies: " + ", ".join(shown), elapsed_s=elapsed_s)
            elif total >= self.rewards.pass_threshold:
                verdict = Verdict.ok(f"reward {total:.4g}: " + ", ".join(shown), elapsed_s=elapsed_s)
            else:
                verdict = Verdict.fail(Status.FAILED, f"reward {total:.4g}: " + ", ".join(shown),
                                       score=min(1.0, max(0.0, total)), elapsed_s=elapsed_s)
        parts = None if failures else [(v, w) for v, w in zip(values, self.rewards.weights)]
        return verdict.model_copy(update={"metrics": metrics, "rewards": parts})


def _with_logs(verdicts: list[Verdict], logs: list[tuple[list[int], _Log]]) -> list[Verdict]:
    """Verdicts with what the successful calls logged: each `log_metric` value once (on the call's first
    attempt, summed per iteration into the mean), each `log_extra` value in its attempt's detail."""
    metrics: list[dict[str, float]] = [dict(v.metrics) for v in verdicts]
    extra: list[list[str]] = [[] for _ in verdicts]
    for indices, log in logs:
        for name, value in log.metrics:
            key = METRIC + name
            target = metrics[indices[0]]
            target[key] = target.get(key, 0.0) + value
            target[f"{key}/n"] = target.get(f"{key}/n", 0.0) + 1.0
        for column, values in log.extra.items():
            for i, value in zip(indices, values):
                extra[i].append(f"{column}: {str(value)[:200]}")
    if not any(log.metrics or log.extra for _, log in logs):
        return verdicts
    return [v.model_copy(update={"metrics": m, "detail": "\n".join([v.detail, *e]) if e else v.detail})
            for v, m, e in zip(verdicts, metrics, extra)]


def _value(v: Any, name: str) -> float | None | _Failure:
    if v is None:
        return None
    if isinstance(v, Exception):  # the function failed on this completion alone (an LLM judge's failed request)
        return _Failure(f"reward function {name!r} raised {describe(v)}")
    if isinstance(v, (str, bytes)):
        return _Failure(f"reward function {name!r} returned {v!r}, not a number")
    try:
        x = float(v)
    except (TypeError, ValueError):
        return _Failure(f"reward function {name!r} returned a {type(v).__name__}, not a number")
    if math.isnan(x):  # TRL's None: not applicable
        return None
    if not math.isfinite(x):
        return _Failure(f"reward function {name!r} returned {x}, not a finite number")
    return x


class RewardFunctionShaper(RewardShaper):
    """Σ weightᵢ·rewardᵢ of a judged completion (the values its verdict carries); 0 for a completion
    no function scored (rejected; GRPO reads its verdict's `rewards` and treats it as unscorable, as
    TRL does) or one a function failed on (crashed: a verifier error, which GRPO treats as unscorable and ES
    leaves out, `vrl.reward.judged`; the 0 is only the run's reward_mean's)."""

    def __init__(self, rewards: RewardFunctions):
        self.rewards = rewards

    def __call__(self, task: Task, completion: Completion, verdict: Verdict) -> float:
        if verdict.status not in (Status.PASSED, Status.FAILED):
            return 0.0
        total = self.rewards.total([verdict.metrics.get(PREFIX + n) for n in self.rewards.names])
        return 0.0 if total is None else total
